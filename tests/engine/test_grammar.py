"""Grammar-constrained generation through the engine (llguidance masks on the tiny random model).

The random model writes no JSON by itself, so every valid document below is the
masks' doing; the unconstrained control shows it.
"""

from __future__ import annotations

import json
import logging
import threading

import jsonschema
import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.grammar import (
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    lark_json,
)
from strata.engine.types import FinishReason, SamplingParams

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 1, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"first": {"type": "string", "maxLength": 8}, "vip": {"type": "boolean"}},
            "required": ["first", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather"]},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def _pet(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=160, grammar=json_schema_grammar(PET, param="schema"), **kw)


@pytest.fixture(scope="module", params=["off", "on"])
def engine(request, tiny_loaded):
    """With the pipeline off (the CPU's default) and on (constrained lanes take ordinary steps)."""
    cfg = EngineConfig(model=tiny_loaded.path, device="cpu", parallel=4, max_context=256,
                       pipeline=request.param)
    with Engine(cfg, loaded=tiny_loaded) as eng:
        yield eng


def _ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def _together(engine: Engine, jobs: list[tuple[str, SamplingParams]]) -> list:
    """Run requests admitted in one loop iteration (the loop is held while they are queued)."""
    gate = threading.Event()
    held = engine.call(gate.wait)
    handles = [engine.generate(_ids(engine, prompt), p) for prompt, p in jobs]
    gate.set()
    held.result()
    return [h.result() for h in handles]


def test_json_schema_output_parses_and_validates(engine) -> None:
    prompt = _ids(engine, "Describe a pet as JSON:")
    before = engine.stats()
    r = engine.complete(prompt, _pet())
    assert r.finish_reason == FinishReason.STOP, r.text
    jsonschema.validate(json.loads(r.text), PET)
    assert r.text == engine.tokenizer.decode(r.token_ids)
    after = engine.stats()
    assert after["grammar_rows"] - before["grammar_rows"] == r.completion_tokens
    assert after["grammar_wait_s"] > before["grammar_wait_s"]
    assert after["grammar_mask_s"] > before["grammar_mask_s"]

    free = engine.complete(prompt, SamplingParams(max_tokens=160))  # the control: no grammar
    with pytest.raises(ValueError):
        json.loads(free.text)


def test_sampled_constrained_output_validates(engine) -> None:
    for seed in (1, 2):
        r = engine.complete(_ids(engine, "A pet:"), _pet(temperature=1.0, seed=seed))
        assert r.finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(r.text), PET)


def test_any_json_object(engine) -> None:
    p = SamplingParams(max_tokens=200, grammar=json_object_grammar())
    r = engine.complete(_ids(engine, "JSON:"), p)
    if r.finish_reason == FinishReason.STOP:  # an open-ended object may run to max_tokens
        assert isinstance(json.loads(r.text), dict)
    else:
        assert r.text.lstrip().startswith("{")


def test_lark_grammar_with_json_inside_tags(engine) -> None:
    rules = f'start: "<tool_call>" call "</tool_call>"\ncall: {lark_json(CALL, param="tools")}\n'
    grammar = lark_grammar(rules)
    engine.grammars.check(grammar, "tools")
    r = engine.complete(_ids(engine, "Call a tool:"), SamplingParams(max_tokens=120, grammar=grammar))
    assert r.finish_reason == FinishReason.STOP
    assert r.text.startswith("<tool_call>") and r.text.endswith("</tool_call>"), r.text
    jsonschema.validate(json.loads(r.text[len("<tool_call>"): -len("</tool_call>")]), CALL)


def test_invalid_schemas_and_grammars_name_their_param(engine) -> None:
    with pytest.raises(GrammarError) as bad_form:
        json_schema_grammar(["not", "a", "schema"], param="response_format")  # type: ignore[arg-type]
    assert bad_form.value.param == "response_format"
    unsatisfiable = json_schema_grammar({"type": "integer", "minimum": 5, "maximum": 2},
                                        param="response_format")
    with pytest.raises(GrammarError, match="minimum") as bad_schema:
        engine.grammars.check(unsatisfiable, "response_format")
    assert bad_schema.value.param == "response_format"
    with pytest.raises(GrammarError, match="false"):
        engine.grammars.check(json_schema_grammar(False, param="response_format"), "response_format")
    with pytest.raises(GrammarError) as bad_lark:
        engine.grammars.check(lark_grammar("start: foo("), "tools")
    assert bad_lark.value.param == "tools"
    # unchecked, it fails at admission, before a lane is touched, and the engine goes on
    with pytest.raises(GrammarError) as at_admission:
        engine.complete(_ids(engine, "x"), SamplingParams(grammar=lark_grammar("start: foo(")))
    assert at_admission.value.param == "grammar"
    assert engine.complete(_ids(engine, "x"), SamplingParams(max_tokens=3)).completion_tokens == 3


def test_checks_from_many_threads(engine) -> None:
    grammar = json_schema_grammar(PET, param="schema")
    errors: list[BaseException] = []

    def check() -> None:
        try:
            engine.grammars.check(grammar, "schema")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=check) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_unconstrained_lanes_are_bit_identical_beside_a_constrained_one(engine) -> None:
    plain = ("The sea is", SamplingParams(max_tokens=24, ignore_eos=True))
    with_lp = ("Once upon a time", SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1))
    constrained = ("A pet:", _pet())
    alone = [engine.complete(_ids(engine, t), p) for t, p in (plain, with_lp)]
    before = engine.stats()["grammar_rows"]
    mixed = _together(engine, [plain, constrained, with_lp])
    assert engine.stats()["grammar_rows"] - before == mixed[1].completion_tokens
    jsonschema.validate(json.loads(mixed[1].text), PET)
    for a, m in zip(alone, [mixed[0], mixed[2]]):
        assert m.token_ids == a.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in m.logprobs] == \
               [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs]


def test_a_matcher_error_ends_only_its_request(engine, caplog) -> None:
    """Bans that leave the grammar no token: the row's pick is one the matcher rejects.

    The grammar allows only "a" (a stop token id here, banned by min_tokens); with
    ignore_eos the row's fallback pick, token 0, is an ordinary token the matcher refuses.
    """
    a = _ids(engine, "a")
    assert len(a) == 1
    cornered = SamplingParams(max_tokens=8, grammar=lark_grammar('start: "a"'), min_tokens=2,
                              stop_token_ids=a, ignore_eos=True)
    plain = ("The sea is", SamplingParams(max_tokens=12, ignore_eos=True))
    alone = engine.complete(_ids(engine, plain[0]), plain[1])
    with caplog.at_level(logging.WARNING, logger="strata.engine"):
        failed, neighbour = _together(engine, [("x", cornered), plain])
    assert failed.finish_reason == FinishReason.STOP and failed.completion_tokens == 1
    assert neighbour.token_ids == alone.token_ids
    warnings = [r for r in caplog.records if "grammar matcher failed" in r.getMessage()]
    assert len(warnings) == 1 and "req-" in warnings[0].getMessage()
