"""Every error answer: status, JSON shape, headers, and that the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import API_KEY, ServerThread
from fake_engine import FakeEngine

from strata.errors import KvPoolFull, QueueFull
from strata.serve import attach_engine, build_app

CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


def oai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def claude_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


def test_malformed_json_both_shapes(http: httpx.Client) -> None:
    err = oai_error(http.post(CHAT, content=b'{"model": "m", "messages": [', headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in err["message"] and err["type"] == "invalid_request_error"
    as_json = {"content-type": "application/json"}
    assert "not valid JSON" in claude_error(http.post(MSGS, content=b"{nope", headers=as_json), 400,
                                            "invalid_request_error")
    assert "empty" in oai_error(http.post(CHAT, content=b"", headers=as_json), 400)["message"]
    assert "JSON object" in oai_error(http.post(CHAT, json=[1, 2]), 400)["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"messages": USER, "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"messages": USER, "temperature": 3}, "temperature", "less than or equal"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'system'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "no accepted form"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", "'image_url' is not supported"),
    ({}, "messages", "Missing required field"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": USER, "frobnicate": 1}, "frobnicate", "Unrecognized request field"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra", "Unrecognized"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"messages": USER, "stop": ["", "x"]}, "stop", "must not be empty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "needs the tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "only assistant messages"),
])
def test_bad_openai_fields_name_the_field(http: httpx.Client, body: dict, param: str, words: str) -> None:
    err = oai_error(http.post(CHAT, json={"model": "m", **body}), 400)
    assert (err["param"] or "") == param, err
    assert words in err["message"], err
    if param:
        assert f"'{param}'" in err["message"]


@pytest.mark.parametrize("field, value", [
    ("n", 2), ("functions", [{"name": "f"}]), ("typical_p", 0.5), ("modalities", ["audio"]),
    ("reasoning_effort", "high"),
])
def test_unimplemented_openai_fields_are_refused_not_ignored(http: httpx.Client, field: str, value: Any) -> None:
    err = oai_error(http.post(CHAT, json={"model": "m", "messages": USER, field: value}), 400)
    assert err["param"] == field and "not supported" in err["message"]
    assert err["code"] == "unsupported_parameter"


def test_neutral_values_of_unimplemented_fields_pass(http: httpx.Client) -> None:
    r = http.post(CHAT, json={"model": "m", "messages": USER, "n": 1, "tools": [], "logit_bias": {},
                              "response_format": {"type": "text"}, "temperature": 0, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Yo"


def test_completions_refusals(http: httpx.Client) -> None:
    assert oai_error(http.post("/v1/completions", json={"prompt": ["a", "b"]}), 400)["param"] == "prompt"
    assert oai_error(http.post("/v1/completions", json={"prompt": "a", "echo": True}), 400)["param"] == "echo"
    assert oai_error(http.post("/v1/completions", json={"prompt": [-1]}), 400)["param"] == "prompt"


@pytest.mark.parametrize("body, words", [
    ({"messages": USER}, "Missing required field: 'max_tokens'"),
    ({"messages": USER, "max_tokens": 5, "tools": [{"name": "f"}]}, "'tools[0].input_schema'"),
    ({"messages": USER, "max_tokens": 5, "mcp_servers": [{"url": "x"}]}, "'mcp_servers' is not supported"),
    ({"messages": USER, "max_tokens": 5, "top_k": -1}, "'top_k'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5},
     "'image' is not supported"),
    ({"messages": USER, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 4000}},
     "must be less than max_tokens"),
    ({"messages": USER, "max_tokens": 5, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"messages": USER, "max_tokens": 5, "system": 7}, "'system'"),
])
def test_bad_anthropic_fields(http: httpx.Client, body: dict, words: str) -> None:
    message = claude_error(http.post(MSGS, json={"model": "m", **body}), 400, "invalid_request_error")
    assert words in message


def test_context_too_long_names_both_numbers(http: httpx.Client, engine: FakeEngine) -> None:
    prompt_len = len("<|user|>hi\n<|assistant|>")
    err = oai_error(http.post(CHAT, json={"model": "m", "messages": USER, "max_tokens": 250}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert str(prompt_len) in err["message"] and "250" in err["message"] and "256" in err["message"]
    long = [{"role": "user", "content": "x" * 300}]
    err = oai_error(http.post(CHAT, json={"model": "m", "messages": long}), 400)
    assert "256" in err["message"] and str(300 + len("<|user|>\n<|assistant|>")) in err["message"]
    msg = claude_error(http.post(MSGS, json={"model": "m", "messages": USER, "max_tokens": 250}), 400,
                       "invalid_request_error")
    assert "250" in msg and "256" in msg
    assert engine.calls == []  # refused before reaching the engine


@pytest.mark.parametrize("stream", [False, True])
def test_pool_full_is_503_with_retry_after(http: httpx.Client, engine: FakeEngine, stream: bool) -> None:
    engine.refuse = KvPoolFull("KV pool full: no free chunks", retry_after=9.2)
    r = http.post(CHAT, json={"model": "m", "messages": USER, "stream": stream})
    err = oai_error(r, 503)
    assert err["code"] == "kv_pool_full" and r.headers["retry-after"] == "10"
    r = http.post(MSGS, json={"model": "m", "messages": USER, "max_tokens": 5, "stream": stream})
    assert "KV pool full" in claude_error(r, 503, "overloaded_error")
    assert r.headers["retry-after"] == "10"
    engine.refuse = QueueFull("64 requests are already waiting", retry_after=1)
    r = http.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert oai_error(r, 503)["code"] == "queue_full" and r.headers["retry-after"] == "1"


def test_sdks_see_overload_with_its_header(oai: openai.OpenAI, claude: anthropic.Anthropic,
                                           engine: FakeEngine) -> None:
    engine.refuse = KvPoolFull("KV pool full", retry_after=3)
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model="m", messages=USER)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "3"
    assert e.value.code == "kv_pool_full"
    with pytest.raises(anthropic.APIStatusError) as a:
        claude.messages.create(model="m", max_tokens=5, messages=USER)
    assert a.value.status_code == 503 and a.value.body["error"]["type"] == "overloaded_error"


def test_unexpected_engine_error_is_500_and_server_survives(http: httpx.Client, engine: FakeEngine) -> None:
    engine.refuse = RuntimeError("boom")
    err = oai_error(http.post(CHAT, json={"model": "m", "messages": USER}), 500)
    assert err["type"] == "server_error" and "boom" in err["message"]
    r = http.post(MSGS, json={"model": "m", "messages": USER, "max_tokens": 5})
    assert "boom" in claude_error(r, 500, "api_error")
    engine.refuse = None
    assert http.post(CHAT, json={"model": "m", "messages": USER}).status_code == 200


def test_unexpected_error_outside_the_engine_is_500(http: httpx.Client, engine: FakeEngine,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: Any, **k: Any) -> list[int]:
        raise KeyError("tokenizer bug")

    monkeypatch.setattr(engine.tokenizer, "encode", broken)
    err = oai_error(http.post(CHAT, json={"model": "m", "messages": USER}), 500)
    assert "tokenizer bug" in err["message"]
    monkeypatch.undo()
    assert http.post(CHAT, json={"model": "m", "messages": USER}).status_code == 200


def test_failure_mid_stream_sends_an_error_event(oai: openai.OpenAI, claude: anthropic.Anthropic,
                                                 engine: FakeEngine) -> None:
    engine.fail_after = 3
    with pytest.raises(openai.APIError, match="fake engine exploded"):
        for _ in oai.chat.completions.create(model="m", messages=USER, stream=True):
            pass
    with pytest.raises(anthropic.APIError, match="fake engine exploded"):
        with claude.messages.stream(model="m", max_tokens=50, messages=USER) as s:
            for _ in s:
                pass


# A stream per route: (path, body); each ends, once its headers are out, with its dialect's last lines.
STREAMS = [(CHAT, {"model": "m", "messages": USER, "stream": True}),
           ("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}),
           (MSGS, {"model": "m", "messages": USER, "max_tokens": 50, "stream": True}),
           ("/completion", {"prompt": "hi", "stream": True})]


def _tail(lines: list[str], path: str) -> dict[str, Any]:
    """The error a stream ended with, checking what follows it: OpenAI's [DONE], nothing else."""
    if path in (CHAT, "/v1/completions"):
        assert lines[-1] == "data: [DONE]", lines[-3:]  # OpenAI clients stop reading there
        lines = lines[:-1]
    if path == MSGS:
        assert lines[-2] == "event: error", lines[-3:]
    return json.loads(lines[-1].removeprefix("data: "))


@pytest.mark.parametrize("path, body", STREAMS)
def test_a_stream_cut_short_ends_with_the_apis_last_lines(http: httpx.Client, engine: FakeEngine, path: str,
                                                        body: dict[str, Any]) -> None:
    """A failure, and a stopping server's cancellation (Engine.cancel_all), after the headers."""
    engine.fail_after = 3
    with http.stream("POST", path, json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert "exploded" in json.dumps(_tail(lines, path))
    engine.fail_after, engine.reply, engine.delay = None, "x" * 200, 0.01
    with http.stream("POST", path, json=body) as r:
        lines = []
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 3:
                engine.cancel_all()
    error = _tail(lines, path)["error"]
    assert "cancelled" in (error.get("code") or error["message"])  # Anthropic's errors have no code
    assert len(lines) < 100  # it ended at the cancellation, not after the 200 characters


def test_template_refusal_is_400(http: httpx.Client) -> None:
    err = oai_error(http.post(CHAT, json={"model": "m", "messages": [
        {"role": "user", "content": "BREAK THE TEMPLATE"}]}), 400)
    assert err["param"] == "messages" and "alternate" in err["message"]


def test_unknown_paths_and_methods(http: httpx.Client) -> None:
    assert "No such endpoint" in oai_error(http.post("/v1/nothing", json={}), 404)["message"]
    assert "No such endpoint" in claude_error(http.post("/v1/messages/nothing"), 404, "not_found_error")
    assert "not allowed" in oai_error(http.get(CHAT), 405)["message"]
    assert oai_error(http.get("/v1/models/other-model"), 404)["code"] == "model_not_found"


@pytest.fixture(scope="module")
def locked() -> Iterator[ServerThread]:
    with ServerThread(build_app(FakeEngine(), api_key=API_KEY)) as srv:
        yield srv


def test_api_key_required_except_health(locked: ServerThread) -> None:
    with httpx.Client(base_url=locked.url) as c:
        assert c.get("/health").status_code == 200
        err = oai_error(c.post(CHAT, json={"model": "m", "messages": USER}), 401)
        assert err["code"] == "invalid_api_key"
        claude_error(c.post(MSGS, json={}), 401, "authentication_error")
        assert c.get("/metrics").status_code == 401
        oai_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    good = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=API_KEY, max_retries=0)
    assert good.chat.completions.create(model="m", messages=USER, max_tokens=2).choices[0].message.content
    bad = anthropic.Anthropic(base_url=locked.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="m", max_tokens=5, messages=USER)
    assert anthropic.Anthropic(base_url=locked.url, api_key=API_KEY, max_retries=0).messages.create(
        model="m", max_tokens=5, messages=USER).content[0].text


def test_loading_engine_answers_503_until_attached() -> None:
    app = build_app(None, model_name="later")
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = c.post(CHAT, json={"model": "m", "messages": USER})
        assert oai_error(r, 503)["code"] == "loading" and r.headers["retry-after"] == "1"
        assert c.get("/v1/models").json()["data"][0]["id"] == "later"
        assert "strata_ready 0.0" in c.get("/metrics").text
        attach_engine(app, FakeEngine())
        assert c.get("/health").json() == {"status": "ok", "model": "fake-model"}
        assert c.post(CHAT, json={"model": "m", "messages": USER}).status_code == 200


def test_engine_without_tokenizer_is_a_server_error(http: httpx.Client, engine: FakeEngine,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "tokenizer", None)
    err = oai_error(http.post(CHAT, json={"model": "m", "messages": USER}), 500)
    assert err["code"] == "no_tokenizer"
    assert "no tokenizer" in claude_error(http.post(MSGS, json={"model": "m", "messages": USER, "max_tokens": 5}),
                                          500, "api_error")
