"""Agents against a real `strata serve` on the default model, through the official SDKs.

SmolLM2-135M's template knows nothing of tools, so these run the generic
format; a forced call is held to its schema by the grammar, which is what
makes a 135M model's arguments valid at all. Each answer is checked with
`jsonschema`, the oracle for "valid against the schema".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from serve_process import GREEDY, ServeProcess

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
OAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": WEATHER}}]
CLAUDE_TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["person"], "properties": {
        "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                   "properties": {"name": {"type": "string", "maxLength": 16},
                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}}}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["color"],
             "properties": {"color": {"enum": ["red", "green", "blue"]}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["tags"], "properties": {
        "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 10}}}},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["score", "ratio"], "properties": {
        "score": {"type": "integer", "minimum": 1, "maximum": 10},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}}},
}


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess("smol-tools", ["--parallel", "2", "--max-context", "2048"],
                        tmp_path_factory.mktemp("serve-tools"))
    yield proc.wait_ready()
    proc.terminate()
    log = proc.stop()
    assert proc.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_openai_tool_loop(smol: ServeProcess) -> None:
    client = smol.oai()
    first = client.chat.completions.create(model="m", messages=ASK, tools=OAI_TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, **GREEDY)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    with client.chat.completions.stream(model="m", messages=ASK, tools=OAI_TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=120, **GREEDY) as stream:
        streamed = stream.get_final_completion().choices[0].message.tool_calls[0]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    history = [*ASK, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    final = client.chat.completions.create(model="m", messages=history, tools=OAI_TOOLS, max_tokens=40, **GREEDY)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert final.usage.prompt_tokens_details.cached_tokens > 0  # the loop's prefix was reused


def test_anthropic_tool_loop(smol: ServeProcess) -> None:
    client = smol.claude()
    first = client.messages.create(model="m", max_tokens=120, messages=ASK, tools=CLAUDE_TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model="m", max_tokens=120, messages=ASK, tools=CLAUDE_TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert next(b for b in streamed.content if b.type == "tool_use").input == use.input
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "Sunny, 21 C"}]}]
    final = client.messages.create(model="m", max_tokens=40, messages=history, tools=CLAUDE_TOOLS,
                                   extra_body={"temperature": 0})
    assert final.stop_reason in ("end_turn", "max_tokens") and final.content[0].text


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema(smol: ServeProcess, name: str) -> None:
    schema = SCHEMAS[name]
    r = smol.oai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"Give me an example {name} object as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        max_tokens=200, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_unconstrained_output_is_not_schema_valid(smol: ServeProcess) -> None:
    """The negative control: the same request without the grammar does not give the object."""
    r = smol.oai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Give me an example numbers object as JSON."}],
        max_tokens=200, **GREEDY)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["numbers"])


def test_invalid_schemas_are_400s_naming_the_field(smol: ServeProcess, tmp_path: Path) -> None:
    http = smol.http()
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    r = http.post("/v1/chat/completions", json={
        "model": "m", "messages": ASK,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format"), r.text
    tools = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "tools": tools,
                                                 "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert http.get("/health").status_code == 200
