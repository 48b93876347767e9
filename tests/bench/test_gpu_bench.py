"""`python -m benchmarks.gpu_bench` without a GPU: its flags, the engine it sizes, eager steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.engine_runs import eager_steps
from benchmarks.gpu_bench import engine_config, parser


def test_the_pool_holds_every_lane_and_the_longest_prompt_read() -> None:
    args = parser().parse_args(["m.gguf", "--lanes", "1,16", "--prompt-lengths", "512,8192"])
    cfg = engine_config(args, [1, 16], [512, 8192])
    assert (cfg.parallel, cfg.max_context, cfg.kv_chunk) == (16, 8256, 1024)
    per_lane_chunks = 1  # 512 + 128 + 1 positions
    assert cfg.kv_pool_tokens == (16 * per_lane_chunks + 9 + 1) * 1024
    assert cfg.pipeline == "auto" and cfg.max_queued == 64


def test_eager_steps_takes_the_graphs_out_and_puts_them_back() -> None:
    graphs = object()
    runner = SimpleNamespace(graphs=graphs)
    with eager_steps(runner):  # type: ignore[arg-type]
        assert runner.graphs is None
    assert runner.graphs is graphs
    with pytest.raises(RuntimeError), eager_steps(runner):  # type: ignore[arg-type]
        raise RuntimeError("a failed stage")
    assert runner.graphs is graphs
