"""The embedded default model through the engine: real answers, exact lanes."""

from __future__ import annotations

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.models import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, device="cpu", dtype="bfloat16", weights="auto", progress=False)  # gguf


def _chat(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))


def test_capital_of_france_is_paris(loaded) -> None:
    with Engine(EngineConfig(max_context=512), loaded=loaded) as eng:
        r = eng.complete(_chat(loaded, "What is the capital of France?"), SamplingParams(max_tokens=24))
    assert "Paris" in r.text
    assert r.finish_reason.value == "stop"  # the model ends its turn with <|im_end|>


def test_lanes_match_running_alone_with_pool_on_and_off(loaded) -> None:
    prompts = [_chat(loaded, q) for q in ("Name a fruit.", "What is 2+2?", "Say hi.", "Name a color.")]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with Engine(EngineConfig(max_context=256, parallel=1), loaded=loaded) as eng:
        alone = [eng.complete(p, params).token_ids for p in prompts]
    for pool in (None, 512):
        cfg = EngineConfig(max_context=256, parallel=4, kv_pool_tokens=pool, kv_chunk=64)
        with Engine(cfg, loaded=loaded) as eng:
            handles = [eng.generate(p, params) for p in prompts]
            assert [h.result().token_ids for h in handles] == alone


def test_default_weights_on_the_cpu_follow_the_file(loaded) -> None:
    """The embedded file is Q4_1 (with a Q8_0 embedding): its blocks are held as they are, and the
    weights take the file's bytes, not more."""
    from strata.models.blocks import BlockEmbedding, BlockLinear, weight_bytes

    assert loaded.weights == "gguf" and loaded.identity.endswith("+gguf")
    assert isinstance(loaded.model.embed_tokens, BlockEmbedding)
    assert isinstance(loaded.model.layers[0].mlp.down_proj, BlockLinear)
    held = weight_bytes(loaded.model)["cpu"]
    assert abs(held - loaded.file_bytes) < 0.01 * loaded.file_bytes


def test_json_schema_answer(loaded) -> None:
    """A real model under a schema answers in valid JSON; unconstrained it does not follow the schema."""
    import json

    import jsonschema

    from strata.engine.grammar import json_schema_grammar

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "city": {"enum": ["Paris", "London", "Rome"]}}}
    prompt = _chat(loaded, "Describe a person with a name, an age and a city, as JSON.")
    with Engine(EngineConfig(max_context=512), loaded=loaded) as eng:
        grammar = json_schema_grammar(schema, param="response_format")
        r = eng.complete(prompt, SamplingParams(max_tokens=80, grammar=grammar))
        free = eng.complete(prompt, SamplingParams(max_tokens=80))
    assert r.finish_reason.value == "stop"
    jsonschema.validate(json.loads(r.text), schema)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free.text), schema)
