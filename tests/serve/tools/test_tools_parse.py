"""Parsing whole outputs of each family: content, calls, ids, and what counts as broken."""

from __future__ import annotations

import json

import pytest
from tool_outputs import ALL, TOOL_NAMES, Case, counter_ids

from strata.serve.tools import HermesFormat, Llama3JsonFormat, MistralFormat, ToolCall
from strata.serve.tools.format import ToolFormat
from strata.serve.tools.ids import new_call_id

FORMATS: dict[str, ToolFormat] = {
    "hermes": HermesFormat(),
    "llama3_json": Llama3JsonFormat(),
    "mistral": MistralFormat(named_calls=False),
}


@pytest.mark.parametrize("case", ALL, ids=lambda c: f"{c.family}: {c.label}")
def test_parse(case: Case) -> None:
    parsed = FORMATS[case.family].parse(case.text, TOOL_NAMES, counter_ids())
    assert parsed.content == case.content
    expected = [ToolCall(f"call_{i}", n, a) for i, (n, a) in enumerate(case.calls)]
    assert parsed.calls == expected
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


def test_arguments_keep_the_model_text() -> None:
    """Escapes and spacing are the model's own: the text is passed on, not re-encoded."""
    args = '{"s":"\\u00e9\\"",  "n" : 1.50}'
    text = f'<tool_call>{{"name": "search", "arguments": {args}}}</tool_call>'
    (call,) = HermesFormat().parse(text, TOOL_NAMES, counter_ids()).calls
    assert call.arguments == args
    assert json.loads(call.arguments) == {"s": 'é"', "n": 1.5}


def test_only_offered_tools_are_calls() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert HermesFormat().parse(text, set(), counter_ids()).content == text
    assert HermesFormat().parse(text, {"get_time"}, counter_ids()).calls[0].name == "get_time"


def test_default_ids_are_openai_shaped() -> None:
    text = '{"name": "get_time", "parameters": {}}'
    (call,) = Llama3JsonFormat().parse(text, TOOL_NAMES).calls
    assert call.id.startswith("call_") and len(call.id) == 29
    int(call.id[5:], 16)
    assert new_call_id() != new_call_id()


def test_named_mistral_form_is_read_by_either_variant() -> None:
    text = '[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}'
    for fmt in (MistralFormat(named_calls=True), MistralFormat(named_calls=False)):
        assert [c.name for c in fmt.parse(text, TOOL_NAMES, counter_ids()).calls] == ["get_time"]


@pytest.mark.parametrize(
    "text",
    ["", " ", "<tool_call>", "<tool_call>\n{", "{", "[TOOL_CALLS]", "[TOOL_CALLS][",
     "<|python_tag|>"],
)
def test_nothing_but_beginnings(text: str) -> None:
    for fmt in FORMATS.values():
        parsed = fmt.parse(text, TOOL_NAMES, counter_ids())
        assert parsed.calls == [] and parsed.content == text


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "' * 2000,
        "<tool_call>" * 3000,
        "[TOOL_CALLS]" + "a" * 5000,
        '{"name": "search", "parameters": {"' + "<tool_call>" * 500,
        "<tool_call>\n" + " " * 20000 + "x",
    ],
    ids=["names in names", "openers", "long name", "openers in a key", "long whitespace"],
)
def test_pathological_outputs_stay_text(text: str) -> None:
    for fmt in FORMATS.values():
        parsed = fmt.parse(text, TOOL_NAMES, counter_ids())
        assert parsed.calls == [] or fmt.name == "llama3_json"
        assert parsed.content or parsed.calls
