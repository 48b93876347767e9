"""Speculative decoding on CUDA: drafted runs verified as rows of the decode graph, and the engine's
answers with drafts against without."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton")
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.graphs import DecodeGraphs
from strata.engine.types import SamplingParams
from strata.kv.step import SeqSpec
from tests.engine.test_speculative import _decoy, _prompt
from tests.gpu.test_decode_graphs import CFG, _eager, _pool, _prompts
from tests.gpu.test_decode_graphs import model as model  # noqa: F401 - the fixture

DEV = "cuda"


def test_a_drafted_run_as_graph_rows_is_the_run_read_at_once(model) -> None:  # noqa: F811
    """Rows j of one lane's run attend over what rows < j wrote in the same layer: the replay equals
    the eager padded step bit for bit and is close to the run read as one sequence."""
    pool, ref_pool = _pool("bf16"), _pool("bf16")
    graphs = DecodeGraphs(model, pool, CFG.head_dim**-0.5, rows_per_lane=5)
    lens = _prompts(model, [pool, ref_pool], {0: 40, 2: 77})
    run = [SeqSpec(0, lens[0], 5), SeqSpec(2, lens[2], 1)]  # a drafted run beside a plain decode
    tokens = [11, 12, 13, 14, 15, 16]
    rows = graphs.rows_of(run, [5, 1])
    assert rows is not None and len(rows) == 6 and graphs.size_for(6) == 8
    assert graphs.rows_of(run, [1, 1]) is None  # a run not sampled in full is not rows
    eager = graphs.eager(rows, tokens)
    replay = graphs.forward(rows, tokens).clone()
    assert torch.equal(eager, replay)
    with torch.inference_mode():
        ref = torch.cat([_eager(model, ref_pool, [SeqSpec(0, lens[0], j + 1)], tokens[: j + 1]) for j in range(5)])
    rel = float((replay[:5] - ref).norm() / ref.norm())
    assert rel < 2e-2, rel
    assert torch.equal(replay[:5].argmax(-1), ref.argmax(-1)) or rel < 5e-3


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory: pytest.TempPathFactory, gpu_tokenizer: str):
    """The tests' tiny random llama in float32 on CUDA, with the default model's tokenizer."""
    from gguf import GGUFReader

    from strata.gguf.reader import field_value
    from strata.models import load_model
    from strata.tokenizer import Tokenizer
    from tests.tiny_llama import write_tiny_llama

    reader = GGUFReader(gpu_tokenizer)  # a tokenizer-only file: its fields as they are
    tok = Tokenizer.from_gguf_metadata({k: field_value(reader, k) for k in reader.fields}, gpu_tokenizer)
    out = write_tiny_llama(tmp_path_factory.mktemp("tiny-spec"), tok.vocab_size, tok.bos_token_id,
                           tok.eos_token_id)
    loaded = load_model(str(out), device="cuda", dtype="float32", weights="dense", progress=False)
    return dataclasses.replace(loaded, tokenizer=tok)


def test_the_engine_verifies_drafts_on_the_gpu(tiny_cuda) -> None:
    """float32 on the tiny model: the answers with drafts (through the graphs) are the answers
    without, where logits are far enough apart that the GPU's batch-dependent rounding does not
    decide (docs/SPECULATIVE.md: exact by construction on the CPU, not yet on the GPU)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outs = {}
    for spec in (0, 4):
        with Engine(EngineConfig(max_context=512, parallel=2, spec=spec), loaded=tiny_cuda) as eng:
            first = eng.complete(_prompt(0), params).token_ids
            eng.complete(*_decoy(_prompt(0), first, 9))
            again = eng.complete(_prompt(0), params).token_ids
            outs[spec] = (first, again, eng.stats(), eng.runner.graphs is not None)
    (first0, again0, _, _), (first4, again4, stats, graphed) = outs[0], outs[4]
    assert graphed
    spec = stats["speculation"]
    assert 0 < spec["accepted_tokens"] < spec["drafted_tokens"]
    assert again4 == again0 == first0 and first4 == first0
