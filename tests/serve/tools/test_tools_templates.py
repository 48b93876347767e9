"""Tool conversations render through our template renderer exactly as through transformers."""

from __future__ import annotations

from typing import Any

import pytest
from tool_templates import template
from transformers.utils.chat_template_utils import render_jinja_template

from strata.errors import BadRequest
from strata.serve.tools import (
    GenericFormat,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    Tool,
    ToolCall,
    assistant_with_calls,
    format_for_template,
    template_supports_tools,
    tool_result,
)
from strata.serve.tools.format import ToolFormat
from strata.tokenizer import render_chat_template

TOOLS = [
    Tool(
        "get_weather",
        "Current weather for a city",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    ),
    Tool("get_time", None, {"type": "object", "properties": {"timezone": {"type": "string"}}}),
]
CALLS = [
    ToolCall(
        "call_6c0d1ab2e3f4a5b6c7d8e9f0", "get_weather", '{"city": "Zürich", "unit": "celsius"}'
    ),
    ToolCall("call_0a1b2c3d4e5f60718293a4b5", "get_time", '{"timezone": "Europe/Zurich"}'),
]
RESULTS = [
    tool_result(CALLS[0].id, "get_weather", '{"temperature": 21, "sky": "clear"}'),
    tool_result(CALLS[1].id, "get_time", "14:05"),
]
START = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Weather and time in Zürich?"},
]
END = [
    {"role": "assistant", "content": "It is 21 °C and clear; the time is 14:05."},
    {"role": "user", "content": "And tomorrow?"},
]
TWO_CALLS = START + [assistant_with_calls(None, CALLS), *RESULTS] + END
ONE_CALL_EACH = (
    START
    + [assistant_with_calls(None, CALLS[:1]), RESULTS[0]]
    + [assistant_with_calls("", CALLS[1:]), RESULTS[1]]
    + END
)
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def both(template_text: str, fmt: ToolFormat, messages: list[dict[str, Any]]) -> tuple[str, str]:
    given = fmt.for_template(messages, TOOLS)
    ours = render_chat_template(
        template_text, given.messages, add_generation_prompt=True, tools=given.tools, **SPECIAL
    )
    rendered, _ = render_jinja_template(
        [given.messages], tools=given.tools, chat_template=template_text,
        add_generation_prompt=True, **SPECIAL,
    )
    return ours, rendered[0]


@pytest.mark.parametrize(
    ("name", "fmt", "messages"),
    [
        ("qwen3.jinja", HermesFormat(), TWO_CALLS),
        ("llama3.1.jinja", Llama3JsonFormat(), ONE_CALL_EACH),
        ("mistral_nemo.jinja", MistralFormat(named_calls=False), TWO_CALLS),
    ],
)
def test_tool_conversation_renders_like_transformers(name: str, fmt: ToolFormat, messages) -> None:
    ours, theirs = both(template(name), fmt, messages)
    assert ours == theirs
    assert "get_weather" in ours and "Europe/Zurich" in ours and "14:05" in ours


def test_qwen3_shows_calls_as_the_model_writes_them() -> None:
    ours, _ = both(template("qwen3.jinja"), HermesFormat(), TWO_CALLS)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time"' in ours
    )
    assert "<tool_response>\n14:05\n</tool_response>" in ours


def test_llama_refuses_two_calls_in_one_turn_in_both_renderers() -> None:
    text = template("llama3.1.jinja")
    given = Llama3JsonFormat().for_template(TWO_CALLS, TOOLS)
    with pytest.raises(BadRequest, match="single tool-calls"):
        render_chat_template(text, given.messages, tools=given.tools, **SPECIAL)
    with pytest.raises(Exception, match="single tool-calls"):
        render_jinja_template([given.messages], tools=given.tools, chat_template=text, **SPECIAL)


def test_mistral_gets_nine_character_ids_that_pair_calls_with_results() -> None:
    ours, _ = both(template("mistral_nemo.jinja"), MistralFormat(named_calls=False), TWO_CALLS)
    given = MistralFormat(named_calls=False).for_template(TWO_CALLS, TOOLS)
    ids = [c["id"] for c in given.messages[2]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    assert [m["tool_call_id"] for m in given.messages[3:5]] == ids
    assert f'"call_id": "{ids[1]}"' in ours


def test_generic_renders_through_the_default_model_template(smol) -> None:
    text = smol.chat_template
    ours, theirs = both(text, GenericFormat(), TWO_CALLS)
    assert ours == theirs
    assert ours.startswith("<|im_start|>system\nYou can call tools")
    assert "You are a concise assistant." in ours
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Zürich", "unit": "celsius"}}\n</tool_call>\n<tool_call>' in ours
    )
    assert (
        "<|im_start|>user\n<tool_response>\n"
        '{"temperature": 21, "sky": "clear"}\n</tool_response>\n<tool_response>\n14:05\n'
        "</tool_response><|im_end|>" in ours
    )


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("qwen3.jinja", HermesFormat),
        ("llama3.1.jinja", Llama3JsonFormat),
        ("mistral_nemo.jinja", MistralFormat),
    ],
)
def test_format_for_each_fixture(name: str, kind: type) -> None:
    text = template(name)
    assert template_supports_tools(text)
    fmt = format_for_template(text)
    assert type(fmt) is kind
    if isinstance(fmt, MistralFormat):
        assert not fmt.named_calls


def test_format_for_templates_without_tools(smol) -> None:
    assert not template_supports_tools(smol.chat_template)
    assert type(format_for_template(smol.chat_template)) is GenericFormat
    assert type(format_for_template(None)) is GenericFormat
    unknown_family = "{% for t in tools %}<fn>{{ t | tojson }}</fn>{% endfor %}"
    assert type(format_for_template(unknown_family)) is GenericFormat


def test_newer_mistral_templates_get_named_calls() -> None:
    text = "{% for t in tools %}{% endfor %}[TOOL_CALLS]{{ name }}[ARGS]{{ args }}"
    fmt = format_for_template(text)
    assert isinstance(fmt, MistralFormat) and fmt.named_calls
    assert fmt.markers == ("[TOOL_CALLS]", "[ARGS]")
