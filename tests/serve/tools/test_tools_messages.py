"""Tools and tool turns as chat templates expect them, and folded for plain templates."""

from __future__ import annotations

import json

from strata.serve.tools import (
    GenericFormat,
    Tool,
    ToolCall,
    assistant_with_calls,
    instruction,
    mistral_call_id,
    plain_messages,
    template_tools,
    tool_result,
    with_instruction,
)

WEATHER = Tool(
    "get_weather",
    "Current weather <now>",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CLOCK = Tool("get_time", None, {"type": "object", "properties": {}})
CALL = ToolCall("call_1", "get_weather", '{"city": "Zürich"}')


def test_template_tools() -> None:
    assert template_tools([WEATHER, CLOCK]) == [
        {"type": "function", "function": {
            "name": "get_weather", "description": "Current weather <now>",
            "parameters": WEATHER.parameters,
        }},
        {"type": "function", "function": {"name": "get_time", "parameters": CLOCK.parameters}},
    ]


def test_assistant_with_calls_parses_arguments_for_tojson() -> None:
    broken = ToolCall("call_2", "get_time", '{"tz": ')
    message = assistant_with_calls(None, [CALL, broken])
    assert message == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz": '}},
        ],
    }
    assert list(message["tool_calls"][0]["function"]) == ["name", "arguments"]


def test_tool_result() -> None:
    assert tool_result("call_1", "get_weather", "sunny") == {
        "role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny",
    }


def test_plain_messages_fold_calls_and_results() -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        assistant_with_calls("Checking.", [CALL, ToolCall("call_2", "get_time", "{}")]),
        tool_result("call_1", "get_weather", "sunny"),
        tool_result("call_2", "get_time", {"h": 14}),
        {"role": "user", "content": "Thanks"},
    ]
    assert plain_messages(messages) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": (
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        )},
        {"role": "user", "content": (
            '<tool_response>\nsunny\n</tool_response>\n<tool_response>\n{"h": 14}\n</tool_response>'
        )},
        {"role": "user", "content": "Thanks"},
    ]


def test_a_result_after_a_user_turn_joins_it() -> None:
    folded = plain_messages([{"role": "user", "content": "Go"}, tool_result("c", "t", "ok")])
    assert folded == [{"role": "user", "content": "Go\n<tool_response>\nok\n</tool_response>"}]


def test_instruction_describes_every_tool() -> None:
    text = instruction([WEATHER, CLOCK])
    for tool in template_tools([WEATHER, CLOCK]):
        assert json.dumps(tool, ensure_ascii=False) in text
    shown = '{"name": "<tool name>", "arguments": {<arguments as JSON>}}'
    assert f"<tool_call>\n{shown}\n</tool_call>" in text


def test_instruction_goes_first_in_the_system_message() -> None:
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert with_instruction(system, "TOOLS") == [
        {"role": "system", "content": "TOOLS\n\nBe brief."}, {"role": "user", "content": "Hi"},
    ]
    assert with_instruction(system[1:], "TOOLS") == [
        {"role": "system", "content": "TOOLS"}, {"role": "user", "content": "Hi"},
    ]
    assert system[0]["content"] == "Be brief."  # the caller's messages are left alone


def test_generic_for_template() -> None:
    given = GenericFormat().for_template([{"role": "user", "content": "Hi"}], [CLOCK])
    assert given.tools is None
    assert given.messages[0]["role"] == "system" and "get_time" in given.messages[0]["content"]
    assert GenericFormat().for_template([{"role": "user", "content": "Hi"}], []).messages == [
        {"role": "user", "content": "Hi"}
    ]


def test_mistral_call_ids() -> None:
    assert mistral_call_id("a1B2c3D4e") == "a1B2c3D4e"
    made = mistral_call_id("call_6c0d1ab2e3f4a5b6c7d8e9f0")
    assert len(made) == 9 and made.isalnum()
    assert made == mistral_call_id("call_6c0d1ab2e3f4a5b6c7d8e9f0")
    assert made != mistral_call_id("call_6c0d1ab2e3f4a5b6c7d8e9f1")
