"""Call grammars: valid llguidance grammars that take exactly the calls, then EOS.

Checked by feeding real token sequences (the default model's byte-level
tokenizer) through an llguidance matcher, with invalid calls as controls.
"""

from __future__ import annotations

import json

import llguidance
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from strata.serve.tools import (
    GenericFormat,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    Tool,
    special_ids_for,
)
from strata.serve.tools.format import ToolFormat

TOOLS = [
    Tool(
        "get_weather",
        "Weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    ),
    Tool("get_time", None, {}),  # no schema: any object
]
PARIS = '{"city": "Paris", "days": 2}'
ZURICH = '{"city": "Zürich {\\"x\\"}", "unit": "celsius"}'


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def llama(name: str, args: str) -> str:
    return f'{{"name": "{name}", "parameters": {args}}}'


def mistral(*calls: tuple[str, str]) -> str:
    items = ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls)
    return f"[TOOL_CALLS][{items}]"


def named(name: str, args: str) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{args}"


# format, one call, two calls, a bad call of the right shape
CASES = [
    (
        HermesFormat(),
        hermes("get_weather", PARIS),
        hermes("get_weather", PARIS) + "\n" + hermes("get_time", "{}"),
    ),
    (
        GenericFormat(),
        hermes("get_time", '{"tz": [1, null]}'),
        hermes("get_time", "{}") + "\n" + hermes("get_weather", ZURICH),
    ),
    (
        Llama3JsonFormat(),
        llama("get_weather", ZURICH),
        llama("get_weather", PARIS) + "; " + llama("get_time", "{}"),
    ),
    (
        MistralFormat(named_calls=False),
        mistral(("get_weather", PARIS)),
        mistral(("get_weather", PARIS), ("get_time", "{}")),
    ),
    (
        MistralFormat(named_calls=True),
        named("get_weather", ZURICH),
        named("get_time", "{}") + named("get_weather", PARIS),
    ),
]
BAD_ARGS = [
    '{"days": 2}',  # city is required
    '{"city": 7}',  # wrong type
    '{"city": "Paris", "days": 0}',  # below the minimum
    '{"city": "Paris", "wind": true}',  # not allowed
    '{"city":"Paris"}',  # not the template's spacing
]


@pytest.fixture(scope="module")
def smol_ll(smol) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(smol.backend.to_str(), eos_token=smol.eos_token_id)


def matcher(tokenizer: llguidance.LLTokenizer, lark: str) -> llguidance.LLMatcher:
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    assert llguidance.LLMatcher.validate_grammar(grammar, tokenizer) == ""
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0)


def accepts(m: llguidance.LLMatcher, ids: list[int]) -> bool:
    return m.consume_tokens(ids) and m.is_accepting()


def grammar_of(fmt: ToolFormat, parallel: bool, special_ids: dict[str, int] | None = None) -> str:
    return fmt.call_grammar(TOOLS, parallel=parallel, special_ids=special_ids or {})


@pytest.mark.parametrize(("fmt", "one", "two"), CASES, ids=lambda v: getattr(v, "name", ""))
def test_one_call_then_eos(smol, smol_ll, fmt: ToolFormat, one: str, two: str) -> None:
    m = matcher(smol_ll, grammar_of(fmt, parallel=False))
    assert accepts(m, smol.encode(one)), m.get_error()
    after = m.deep_copy()
    assert after.try_consume_tokens(smol.encode("\n")) == 0  # nothing but EOS may follow
    assert m.consume_token(smol.eos_token_id) and m.is_stopped()
    assert not accepts(matcher(smol_ll, grammar_of(fmt, parallel=False)), smol.encode(two))


@pytest.mark.parametrize(("fmt", "one", "two"), CASES, ids=lambda v: getattr(v, "name", ""))
def test_parallel_calls(smol, smol_ll, fmt: ToolFormat, one: str, two: str) -> None:
    lark = grammar_of(fmt, parallel=True)
    assert accepts(matcher(smol_ll, lark), smol.encode(one))
    m = matcher(smol_ll, lark)
    assert accepts(m, smol.encode(two)), m.get_error()
    assert m.consume_token(smol.eos_token_id)


def test_at_most_eight_parallel_calls(smol, smol_ll) -> None:
    lark = grammar_of(HermesFormat(), parallel=True)
    calls = [hermes("get_time", "{}")] * 9
    assert accepts(matcher(smol_ll, lark), smol.encode("\n".join(calls[:8])))
    assert not accepts(matcher(smol_ll, lark), smol.encode("\n".join(calls)))


@pytest.mark.parametrize("args", BAD_ARGS)
def test_arguments_must_fit_the_schema(smol, smol_ll, args: str) -> None:
    lark = grammar_of(HermesFormat(), parallel=False)
    assert not accepts(matcher(smol_ll, lark), smol.encode(hermes("get_weather", args)))


@pytest.mark.parametrize(
    "text",
    [
        "Sure. " + hermes("get_time", "{}"),  # no text around the call
        hermes("get_date", "{}"),  # not a tool on offer
        '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>',  # name first
        '<tool_call>\n{"name": "get_time", "arguments": []}\n</tool_call>',  # an object
        "It is noon.",
    ],
)
def test_only_a_call_is_accepted(smol, smol_ll, text: str) -> None:
    lark = grammar_of(HermesFormat(), parallel=True)
    assert not accepts(matcher(smol_ll, lark), smol.encode(text))


def test_tool_names_and_schemas_are_escaped(smol, smol_ll) -> None:
    schema = {"properties": {"q": {"type": "string", "pattern": "^a}\"$"}}}
    odd = Tool('we"ird\\näme', None, schema)
    lark = Llama3JsonFormat().call_grammar([odd], parallel=False, special_ids={})
    name = json.dumps(odd.name, ensure_ascii=False)
    text = '{"name": ' + name + ', "parameters": {"q": "a}\\""}}'
    assert accepts(matcher(smol_ll, lark), smol.encode(text))


def test_a_grammar_needs_distinct_tools() -> None:
    with pytest.raises(ValueError):
        HermesFormat().call_grammar([], parallel=False, special_ids={})
    with pytest.raises(ValueError):
        MistralFormat(named_calls=True).call_grammar(TOOLS[:1] * 2, parallel=True, special_ids={})


# -- markers that are single special tokens ------------------------------------------------

MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]")


def with_markers(smol, special: tuple[str, ...], plain: tuple[str, ...]):
    """The default tokenizer with markers added as tokens, flagged special or not."""
    backend = Backend.from_str(smol.backend.to_str())
    backend.add_tokens([AddedToken(m, special=False, normalized=False) for m in plain])
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in special])
    return backend, llguidance.LLTokenizer(backend.to_str(), eos_token=smol.eos_token_id)


@pytest.fixture(scope="module")
def marked(smol) -> tuple[Backend, llguidance.LLTokenizer]:
    """As the models have them: Qwen's tags are added tokens not flagged special (llguidance
    takes them as special all the same), Mistral's markers are flagged special."""
    return with_markers(smol, special=MARKERS[2:], plain=MARKERS[:2])


def test_special_ids_are_found_for_the_markers(smol_ll, marked) -> None:
    backend, tokenizer = marked
    found = special_ids_for(MARKERS, tokenizer)
    assert found == {m: backend.token_to_id(m) for m in MARKERS}
    assert special_ids_for(MARKERS, smol_ll) == {}  # plain text for SmolLM2


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (HermesFormat(), hermes("get_weather", PARIS)),
        (MistralFormat(named_calls=False), mistral(("get_time", "{}"))),
        (MistralFormat(named_calls=True), named("get_weather", PARIS)),
    ],
    ids=["hermes", "mistral", "mistral named"],
)
def test_special_markers_are_written_as_their_token(
    smol, marked, fmt: ToolFormat, text: str
) -> None:
    backend, tokenizer = marked
    special = special_ids_for(fmt.markers, tokenizer)
    assert set(special) == set(fmt.markers)
    as_tokens = backend.encode(text, add_special_tokens=False).ids
    assert set(special.values()) <= set(as_tokens)
    spelled = smol.encode(text)  # the markers in ordinary text tokens
    lark = grammar_of(fmt, parallel=False, special_ids=special)
    m = matcher(tokenizer, lark)
    assert accepts(m, as_tokens), m.get_error()
    assert m.consume_token(smol.eos_token_id)
    assert not accepts(matcher(tokenizer, lark), spelled)
    # Written as a literal, the marker's own token is refused: why special_ids exist.
    assert not accepts(matcher(tokenizer, grammar_of(fmt, parallel=False)), as_tokens)


def test_a_marker_token_llguidance_reads_as_text_stays_a_literal(smol) -> None:
    backend, tokenizer = with_markers(smol, special=(), plain=("[TOOL_CALLS]",))
    fmt = MistralFormat(named_calls=False)
    assert special_ids_for(fmt.markers, tokenizer) == {}
    text = mistral(("get_time", "{}"))
    as_tokens = backend.encode(text, add_special_tokens=False).ids
    assert backend.token_to_id("[TOOL_CALLS]") in as_tokens
    assert accepts(matcher(tokenizer, grammar_of(fmt, parallel=False)), as_tokens)
