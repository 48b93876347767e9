"""Hybrid models on CUDA: Gemma 3's sliding windows and Qwen3-Next's recurrent state give the
CPU engine's greedy tokens, and a repeat resumes through a checkpoint on the device."""

from __future__ import annotations

import logging

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from tests.models.tiny_models import PROMPT, save_byte_tokenizer, save_tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [PROMPT, PROMPT[::-1][:13], PROMPT[3:] + PROMPT]


def _greedy(folder: str, device: str) -> tuple[list[list[int]], list[int], dict]:
    cfg = EngineConfig(model=folder, device=device, dtype="float32", weights="dense", parallel=3,
                       max_context=128, prefill_chunk=8)
    with Engine(cfg) as eng:
        handles = [eng.generate(p, GREEDY) for p in PROMPTS]
        out = [h.result().token_ids for h in handles]
        again = eng.complete(PROMPTS[0], GREEDY)
        return out, again.token_ids, eng.stats()


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_next"])
def test_cuda_answers_as_the_cpu(kind: str, tmp_path) -> None:
    save_tiny(kind, tmp_path)
    save_byte_tokenizer(tmp_path)
    cpu, _, _ = _greedy(str(tmp_path), "cpu")
    cuda, again, stats = _greedy(str(tmp_path), "cuda")
    assert cuda == cpu
    assert again == cuda[0]
    if kind == "qwen3_next":
        assert stats["checkpoints"]["restores"] >= 1


def _decode_run(folder: str, dtype: str, parallel: int, graphs: bool) -> tuple[list[list[int]], list[int]]:
    """Each prompt's greedy tokens (all at once with parallel > 1, else one at a time) and the
    lane counts whose decode graphs were captured."""
    cfg = EngineConfig(model=folder, device="cuda", dtype=dtype, weights="dense", parallel=parallel,
                       max_context=128, prefill_chunk=8)
    with Engine(cfg) as eng:
        if not graphs:
            eng.runner.graphs = eng.runner.prompt_graphs = None
        if parallel == 1:
            out = [eng.complete(p, GREEDY).token_ids for p in PROMPTS]
        else:
            out = [h.result().token_ids for h in [eng.generate(p, GREEDY) for p in PROMPTS]]
        return out, [] if eng.runner.graphs is None else eng.runner.graphs.captured()


@pytest.mark.parametrize("kind,dtype", [("qwen3_next", "float32"), ("qwen3_next", "bfloat16"),
                                        ("qwen3_next_dense", "bfloat16")])
def test_recurrent_decode_replays_graphs(kind: str, dtype: str, tmp_path) -> None:
    """Qwen3-Next's decode steps replay CUDA graphs: each lane's DeltaNet state gathered and
    scattered through its slot on the device, padding rows writing the trash slot. One lane gives
    the tokens of the same engine stepping eagerly (bf16: the FLA kernels); three lanes at once
    (padded to the captured size) give them too in float32, where the kernels' bits do not depend on the
    batch (bf16's do, issue 20's subject)."""
    save_tiny(kind, tmp_path)
    save_byte_tokenizer(tmp_path)
    eager, none = _decode_run(str(tmp_path), dtype, 1, graphs=False)
    alone, one = _decode_run(str(tmp_path), dtype, 1, graphs=True)
    together, sizes = _decode_run(str(tmp_path), dtype, 3, graphs=True)
    assert none == [] and one == [1] and sizes[-1] == 3  # three lanes: sizes 1, 2, 3
    assert alone == eager
    if dtype == "float32":
        assert together == eager


def test_a_graph_that_does_not_capture_leaves_the_steps_eager(tmp_path, caplog) -> None:
    """A capture that fails (here: every decode step's warm-up raises) turns the runner's graphs
    off with one warning; the steps run eagerly and answer as an engine that never had graphs."""
    save_tiny("qwen3_next_dense", tmp_path)
    save_byte_tokenizer(tmp_path)
    eager, _ = _decode_run(str(tmp_path), "float32", 1, graphs=False)
    cfg = EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", weights="dense", parallel=1,
                       max_context=128, prefill_chunk=8)
    with Engine(cfg) as eng:
        graphs = eng.runner.graphs
        assert graphs is not None
        eng.runner.prompt_graphs = None  # the decode graphs' failure alone

        def broken(entry: object) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

        graphs._step = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING):
            out = [eng.complete(p, GREEDY).token_ids for p in PROMPTS]
        assert eng.runner.graphs is None
    assert out == eager
    assert caplog.text.count("did not capture") == 1


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_next", "qwen3_next_mtp"])
def test_cuda_drafts_keep_the_answer(kind: str, tmp_path) -> None:
    """--spec on a hybrid model on CUDA (float32): drafts from a repeated prompt's first answer
    and from decoys that continue it otherwise, verified, the rejected ones' state rewound
    (the DeltaNet layers take the torch code in such a step); with the MTP head as well."""
    from tests.models.tiny_mtp import save_tiny_mtp

    if kind == "qwen3_next_mtp":
        save_tiny_mtp(tmp_path)
    else:
        save_tiny(kind, tmp_path)
    save_byte_tokenizer(tmp_path)
    flags = {"mtp": True} if kind == "qwen3_next_mtp" else {}
    first = [(p, GREEDY) for p in PROMPTS]
    outs = {}
    for spec in (0, 4):
        cfg = EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", weights="dense", parallel=3,
                           max_context=128, spec=spec, **(flags if spec else {}))
        with Engine(cfg) as eng:
            answers = [h.result().token_ids for h in [eng.generate(p, s) for p, s in first]]
            decoys = [eng.complete(PROMPTS[0] + answers[0][:at] + [(t + 7) % 256 for t in answers[0][at:at + 4]],
                                   SamplingParams(max_tokens=1)).token_ids for at in (3, 7)]
            again = [h.result().token_ids for h in [eng.generate(p, s) for p, s in first]]
            outs[spec] = (answers, decoys, again, eng.stats())
    assert outs[4][:3] == outs[0][:3]
    spec_figures = outs[4][3]["speculation"]
    assert spec_figures["drafted_tokens"] > spec_figures["accepted_tokens"] > 0
