"""Grammars, logit_bias and min_tokens on the GPU (masks copied to the device, CUDA graphs, pipeline on).

The tiny random model writes no JSON by itself: every valid document is the
masks' doing, and the unconstrained lane beside them must decode exactly as
it does alone.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

pytest.importorskip("triton")
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.grammar import json_schema_grammar
from strata.engine.types import FinishReason, SamplingParams
from tests.gpu.test_pipeline_gpu import tiny  # noqa: F401 (the shared tiny model fixture)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "n"],
          "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9}}}


def _engine(loaded) -> Engine:  # type: ignore[no-untyped-def]
    cfg = EngineConfig(device="cuda", weights="dense", parallel=4, max_context=256, kv_chunk=32,
                       pipeline="on", prefix_reuse=False)
    return Engine(cfg, loaded=loaded)


def test_constrained_lanes_beside_a_plain_one(tiny) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Valid documents, and the same tokens on a second run of the same batch.

    The plain lane is not compared with a run alone: on the GPU a lane's
    greedy output still depends on its batch company (the batch-invariance issue).
    """
    tok = tiny.tokenizer
    prompt = tok.encode("The quick brown fox")
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    grammar = json_schema_grammar(SCHEMA, param="response_format")

    def batch(eng: Engine) -> list:
        handles = [eng.generate(prompt, plain)]
        handles += [eng.generate(tok.encode(f"pet {i}"), SamplingParams(max_tokens=60, grammar=grammar,
                                                                        temperature=t, seed=i))
                    for i, t in enumerate((0.0, 1.0, 0.7))]
        return [h.result() for h in handles]

    with _engine(tiny) as eng:
        first = batch(eng)
        second = batch(eng)
        stats = eng.stats()
    assert len(first[0].token_ids) == 40
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    for r in first[1:]:
        assert r.finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert stats["grammar_rows"] > 0


def test_logit_bias_and_min_tokens(tiny) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    tok = tiny.tokenizer
    prompt = tok.encode("Once upon a time")
    forced = tok.encode(" fox")[0]
    with _engine(tiny) as eng:
        biased = eng.complete(prompt, SamplingParams(max_tokens=5, logit_bias={forced: 100.0})).token_ids
        eos = tok.eos_token_id
        early = eng.complete(prompt, SamplingParams(max_tokens=20, logit_bias={eos: 100.0}))
        held = eng.complete(prompt, SamplingParams(max_tokens=20, logit_bias={eos: 100.0}, min_tokens=6))
    assert biased == [forced] * 5
    assert early.token_ids == [eos]
    assert len(held.token_ids) == 7 and held.token_ids[-1] == eos
