"""Fields real clients send, streams alive while a prompt is read, refusals after the headers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ServerThread
from fake_engine import FakeEngine

from strata.errors import QueueFull
from strata.serve import build_app

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


def chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post(CHAT, json={"model": "m", "messages": USER, "max_tokens": 8, **fields})


@pytest.mark.parametrize("name,value", [
    ("store", True), ("metadata", {"a": "b"}), ("service_tier", "flex"), ("prompt_cache_key", "k"),
    ("safety_identifier", "u1"), ("keep_alive", "5m"), ("id_slot", 1), ("n_keep", 4),
    ("timings_per_token", True), ("priority", 3), ("cache_prompt", False), ("request_id", "r"),
])
def test_fields_that_cannot_change_the_answer_are_accepted(http: httpx.Client, engine: FakeEngine,
                                                           name: str, value: Any) -> None:
    plain = chat(http).json()["choices"][0]["message"]["content"]
    r = chat(http, **{name: value})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain


def test_llama_cpp_and_vllm_extras_reach_the_engine(http: httpx.Client, engine: FakeEngine) -> None:
    r = chat(http, min_tokens=3, ignore_eos=True, stop_token_ids=[7, 9], logit_bias={"42": 5.5, "7": -100},
             top_k=20, min_p=0.1, repetition_penalty=1.2)
    assert r.status_code == 200, r.text
    p = engine.calls[-1][1]
    assert (p.min_tokens, p.ignore_eos, p.stop_token_ids) == (3, True, [7, 9])
    assert p.logit_bias == {42: 5.5, 7: -100.0}
    assert (p.top_k, p.min_p, p.repetition_penalty) == (20, 0.1, 1.2)
    r = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "min_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and engine.calls[-1][1].min_tokens == 2


@pytest.mark.parametrize("fields,param", [
    ({"n": 2}, "n"), ({"typical_p": 0.5}, "typical_p"), ({"echo": True}, "echo"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"3": 101}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"return_progress": True}, "return_progress"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_fields_that_would_change_the_answer_stay_refused(http: httpx.Client, fields: dict[str, Any],
                                                          param: str) -> None:
    r = chat(http, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_include_stop_str_in_output(http: httpx.Client, engine: FakeEngine) -> None:
    engine.reply = "one two three four"
    r = chat(http, stop=["three"], include_stop_str_in_output=True, max_tokens=50)
    assert r.json()["choices"][0]["message"]["content"] == "one two three"
    assert chat(http, stop=["three"], max_tokens=50).json()["choices"][0]["message"]["content"] == "one two "
    with http.stream("POST", CHAT, json={"model": "m", "messages": USER, "stream": True, "stop": ["three"],
                                         "include_stop_str_in_output": True}) as s:
        text = "".join(_deltas(s.iter_lines()))
    assert text == "one two three"


def _deltas(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: {"):
            for c in json.loads(line[6:]).get("choices", []):
                yield c["delta"].get("content") or ""


@pytest.fixture(scope="module")
def quick_beats(engine: FakeEngine) -> Iterator[ServerThread]:
    """A server whose streams send a keep-alive after 0.2 s of silence."""
    with ServerThread(build_app(engine, keepalive_s=0.2)) as srv:
        yield srv


def test_streams_send_headers_at_once_and_keep_alive_during_a_long_prompt(
    quick_beats: ServerThread, engine: FakeEngine
) -> None:
    engine.prompt_delay = 1.2
    body = {"model": "m", "messages": USER, "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=quick_beats.url, timeout=20) as http:
        t0 = time.monotonic()
        with http.stream("POST", CHAT, json=body) as s:
            headers_after = time.monotonic() - t0
            lines = [line for line in s.iter_lines() if line]
        assert s.status_code == 200 and headers_after < 0.9
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data: {") and '"content": ""' not in line)
        assert lines[:first_data].count(": keep-alive") >= 3
        assert lines[-1] == "data: [DONE]"
        with http.stream("POST", MESSAGES, json={**body, "messages": USER}) as s:
            events = [line for line in s.iter_lines() if line.startswith("event: ")]
        assert events[0] == "event: message_start" and events.count("event: ping") >= 3
        assert events[-1] == "event: message_stop"
    engine.prompt_delay = 0.0
    with httpx.Client(base_url=quick_beats.url, timeout=20) as http:
        with http.stream("POST", CHAT, json=body) as s:  # a quick answer has no keep-alive in it
            assert ": keep-alive" not in list(s.iter_lines())


def test_a_refusal_after_the_headers_is_the_apis_error_event(quick_beats: ServerThread,
                                                              engine: FakeEngine) -> None:
    engine.refuse = QueueFull("3 requests are already waiting", retry_after=1)
    engine.refuse_delay = 0.6
    body = {"model": "m", "messages": USER, "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=quick_beats.url, timeout=20) as http:
        with http.stream("POST", CHAT, json=body) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert s.status_code == 200 and lines[-1] == "data: [DONE]"  # after the error, as after an answer
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "queue_full" and "already waiting" in err["message"]
        with http.stream("POST", MESSAGES, json=body) as s:
            text = s.read().decode()
        assert "event: error" in text and "overloaded_error" in text
        engine.refuse_delay = 0.0  # refused at once: still a status code
        assert http.post(CHAT, json=body).status_code == 503


def test_prompt_progress_on_request(http: httpx.Client, engine: FakeEngine) -> None:
    body = {"model": "m", "messages": USER, "max_tokens": 4, "stream": True, "return_progress": True}
    with http.stream("POST", CHAT, json=body) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    total = len(engine.calls[-1][0])
    assert [p["processed"] for p in progress] == [0, total // 2]
    assert all(p["total"] == total and p["cache"] == 0 and p["time_ms"] >= 0 for p in progress)
    assert engine.calls[-1][1].progress
    with http.stream("POST", CHAT, json={**body, "return_progress": False}) as s:
        assert "prompt_progress" not in s.read().decode()
