"""Pipelined greedy decode on the GPU (CUDA graphs, ids fed on the device): the same results as without.

A tiny random llama (tests/tiny_llama.py) with the default model's tokenizer, which comes
from the embedded model or from `--gpu-tokenizer` (a GGUF holding it, such as the one
`python -m tools.synth OUT --tokenizer-only` writes).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.models import load_model
from strata.tokenizer import Tokenizer

PROMPTS = ["The quick brown fox", "In 1492, Columbus sailed", "Water boils at", "Once upon a time",
           "def fibonacci(n):", "A list of primes: 2, 3,"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, gpu_tokenizer: str):
    path = gpu_tokenizer
    from gguf import GGUFReader

    from strata.gguf.reader import field_value

    reader = GGUFReader(path)  # a tokenizer-only file has no architecture: read its fields as they are
    tok = Tokenizer.from_gguf_metadata({k: field_value(reader, k) for k in reader.fields}, path)
    from tests.tiny_llama import write_tiny_llama

    out = write_tiny_llama(tmp_path_factory.mktemp("tiny-pipe"), tok.vocab_size, tok.bos_token_id,
                           tok.eos_token_id, hidden=128, intermediate=256)
    loaded = load_model(str(out), device="cuda", dtype=torch.bfloat16, weights="dense", progress=False)
    loaded.tokenizer = tok
    return loaded


def _run(loaded, pipeline: str) -> tuple[list[tuple], int]:
    cfg = EngineConfig(device="cuda", weights="dense", parallel=4, max_context=128, kv_chunk=32,
                       pipeline=pipeline, prefix_reuse=False)
    limits = [7, 31, 64, 200, 13, 50]
    with Engine(cfg, loaded=loaded) as eng:
        assert eng.runner.graphs is not None
        handles = [eng.generate(loaded.tokenizer.encode(p), SamplingParams(max_tokens=n, ignore_eos=i != 1))
                   for i, (p, n) in enumerate(zip(PROMPTS, limits))]
        out = [(r.token_ids, r.finish_reason, r.text) for r in (h.result() for h in handles)]
        return out, eng.stats()["pipelined_steps"]


def test_pipelined_gpu_decode_equals_the_ordinary_path(tiny) -> None:
    plain, n_plain = _run(tiny, "off")
    piped, n_piped = _run(tiny, "on")
    assert n_plain == 0 and n_piped > 50
    assert piped == plain
