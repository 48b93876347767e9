"""Tool calls and structured output through both APIs and their SDKs, on the fake engine.

The fake's template knows nothing of tools, so requests take the generic
format: an instruction in the system turn, calls written in hermes tags. The
fake writes whatever `engine.reply` says, so a recorded call can be checked
against what the SDKs build from it, whole and streamed.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fake_engine import FakeEngine

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
OAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CLAUDE_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"{}\\"", "days": 2}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    """Room for the tool instruction: the fake's tokens are characters."""
    return FakeEngine(max_context=16384)


def _system(engine: FakeEngine) -> str:
    messages = engine.tokenizer.template_calls[-1]["messages"]
    return messages[0]["content"] if messages[0]["role"] == "system" else ""


def test_openai_call_whole_and_streamed(oai: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = "Let me look. " + TWO_CALLS
    whole = oai.chat.completions.create(model="m", messages=USER, tools=OAI_TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": 'Paris "{}"', "days": 2}
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert "get_weather" in _system(engine)  # the generic format tells the model about its tools
    with oai.chat.completions.stream(model="m", messages=USER, tools=OAI_TOOLS) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_openai_raw_stream_deltas_follow_the_sdk_shape(http: httpx.Client, engine: FakeEngine) -> None:
    engine.reply = CALL
    body = {"model": "m", "messages": USER, "tools": OAI_TOOLS, "stream": True}
    with http.stream("POST", CHAT, json=body) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    starts = [d["tool_calls"][0] for d in deltas if d.get("tool_calls") and "id" in d["tool_calls"][0]]
    assert len(starts) == 1 and starts[0]["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d.get("tool_calls"))
    assert json.loads(args) == {"city": 'Paris "{}"', "days": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_malformed_call_and_tool_choice_none_come_back_as_text(oai: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = '<tool_call>\n{"name": "get_weather" "arguments": {"city": "x"}}\n</tool_call>'
    r = oai.chat.completions.create(model="m", messages=USER, tools=OAI_TOOLS)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == engine.reply
    engine.reply = CALL
    r = oai.chat.completions.create(model="m", messages=USER, tools=OAI_TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].message.tool_calls is None
    assert "get_weather" not in _system(engine)


def test_forced_calls_carry_a_grammar(oai: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = CALL
    oai.chat.completions.create(model="m", messages=USER, tools=OAI_TOOLS, tool_choice="required")
    grammar = engine.calls[-1][1].grammar
    assert grammar and "get_weather" in grammar and "get_time" in grammar
    assert engine.grammars.checked[-1] == (grammar, "tools")
    oai.chat.completions.create(model="m", messages=USER, tools=OAI_TOOLS,
                                tool_choice={"type": "function", "function": {"name": "get_time"}})
    named = engine.calls[-1][1].grammar
    assert "get_time" in named and "get_weather" not in named
    oai.chat.completions.create(model="m", messages=USER, tools=OAI_TOOLS)
    assert engine.calls[-1][1].grammar is None  # auto: the model decides, the parser reads


def test_openai_tool_loop_history_reaches_the_template(oai: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = CALL
    first = oai.chat.completions.create(model="m", messages=USER, tools=OAI_TOOLS)
    message = first.choices[0].message
    history = [*USER, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                                "content": "sunny, 21 C"}]
    engine.reply = "It is sunny."
    final = oai.chat.completions.create(model="m", messages=history, tools=OAI_TOOLS)
    assert final.choices[0].message.content == "It is sunny." and final.choices[0].finish_reason == "stop"
    rendered = engine.tokenizer.template_calls[-1]["messages"]
    text = json.dumps(rendered)
    assert "get_weather" in text and "sunny, 21 C" in text and "tool_response" in text
    assert {m["role"] for m in rendered} <= {"system", "user", "assistant"}  # generic: plain roles


def test_response_format_becomes_a_grammar(http: httpx.Client, engine: FakeEngine) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    engine.reply = '{"n": 3}'
    body = {"model": "m", "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200 and json.loads(r.json()["choices"][0]["message"]["content"]) == {"n": 3}
    assert engine.calls[-1][1].grammar and engine.grammars.checked[-1][1] == "response_format"
    r = http.post(CHAT, json={"model": "m", "messages": USER, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and engine.calls[-1][1].grammar
    r = http.post(CHAT, json={"model": "m", "messages": USER, "response_format": {"type": "text"}})
    assert r.status_code == 200 and engine.calls[-1][1].grammar is None
    engine.grammars.bad = "unsupported keyword 'foo'"
    r = http.post(CHAT, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "foo" in r.json()["error"]["message"]


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": OAI_TOOLS + OAI_TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_name_the_field(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    r = http.post(CHAT, json={"model": "m", "messages": USER, "tools": OAI_TOOLS, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_tool_messages_name_the_field(http: httpx.Client) -> None:
    r = http.post(CHAT, json={"model": "m", "messages": [*USER, {"role": "tool", "content": "x"}]})
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]
    r = http.post(CHAT, json={"model": "m", "messages": [{"role": "function", "name": "f", "content": "x"}]})
    assert r.status_code == 400 and "deprecated" in r.json()["error"]["message"]


def test_anthropic_tool_use_whole_and_streamed(claude: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.reply = "Checking. " + CALL
    msg = claude.messages.create(model="m", max_tokens=200, messages=USER, tools=CLAUDE_TOOLS)
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == {"city": 'Paris "{}"', "days": 2}
    assert use.id.startswith("toolu_")
    with claude.messages.stream(model="m", max_tokens=200, messages=USER, tools=CLAUDE_TOOLS) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and [b.type for b in streamed.content] == ["text", "tool_use"]
    assert streamed.content[0].text == "Checking." and streamed.content[1].input == use.input


def test_anthropic_tool_loop_and_choices(claude: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.reply = CALL
    first = claude.messages.create(model="m", max_tokens=200, messages=USER, tools=CLAUDE_TOOLS,
                                   tool_choice={"type": "any"})
    assert engine.calls[-1][1].grammar and first.stop_reason == "tool_use"
    use = first.content[-1]
    history = [*USER, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                                             "content": [{"type": "text", "text": "city unknown"}]}]}]
    engine.reply = "Sorry."
    final = claude.messages.create(model="m", max_tokens=200, messages=history, tools=CLAUDE_TOOLS,
                                   tool_choice={"type": "auto"})
    assert final.stop_reason == "end_turn" and final.content[0].text == "Sorry."
    assert engine.calls[-1][1].grammar is None
    assert "Error: city unknown" in json.dumps(engine.tokenizer.template_calls[-1]["messages"])
    claude.messages.create(model="m", max_tokens=200, messages=USER, tools=CLAUDE_TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather"})
    assert "get_weather" in engine.calls[-1][1].grammar
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="m", max_tokens=200, messages=USER, tools=CLAUDE_TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    assert "nope" in str(err.value)


def test_anthropic_output_format(http: httpx.Client, engine: FakeEngine) -> None:
    engine.reply = '{"n": 1}'
    body = {"model": "m", "max_tokens": 50, "messages": USER,
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200 and r.json()["content"][0]["text"] == '{"n": 1}'
    assert engine.grammars.checked[-1][1] == "output_config.format"
