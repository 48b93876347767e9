"""Property-based fuzzing of every route that takes a body: no input gives a 5xx.

Bodies start from each route's schema (valid requests of every shape) and are
then mutated: fields replaced by values of other types, removed or added,
numbers far out of range (integer literals of thousands of digits, NaN,
Infinity), Unicode including lone surrogates, long strings, deep nesting,
broken JSON text and other media types. Every answer must be below 500, in
the route's error shape when it is an error, and the server must still
answer afterwards. It runs in-process on the fake engine, in seconds.

The suite runs max(300, the profile's max_examples) cases; the long run is
`pytest tests/serve/test_serve_fuzz.py --hypothesis-profile=fuzz-long`
(20,000 cases; docs/RELIABILITY.md has its result).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from strata.serve import build_app

CHAT, COMPLETIONS, MSGS, COUNT = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"
HUGE = "__huge_integer__"  # replaced by thousands of digits after json.dumps (which cannot write them)
DEEP = "__deep__"  # "__deep__[1000": an array (or "{" an object) nested that deep, also put in as text
CI_EXAMPLES = 300

# Text of every kind: lone surrogates (category Cs) included, which JSON can carry as \\ud800.
any_text = st.text(st.characters(exclude_categories=()), max_size=40)
plain_text = st.text(st.sampled_from("ab cd\n<|>!é日"), max_size=20)
big_ints = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, -1, 0, HUGE])
scalars = (st.none() | st.booleans() | st.integers() | big_ints
           | st.floats(allow_nan=True, allow_infinity=True) | any_text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(any_text, inner, max_size=4), max_leaves=12)


def _opt(d: st.DrawFn, body: dict[str, Any], key: str, strategy: st.SearchStrategy[Any]) -> None:
    if d(st.booleans()):
        body[key] = d(strategy)


@st.composite
def chat_body(d: st.DrawFn) -> dict[str, Any]:
    roles = st.sampled_from(["system", "developer", "user", "assistant"])
    content = plain_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain_text}), max_size=2)
    body: dict[str, Any] = {"model": "m", "messages": d(st.lists(
        st.fixed_dictionaries({"role": roles, "content": content}), min_size=1, max_size=3))}
    _sampling(d, body)
    _opt(d, body, "max_completion_tokens", st.integers(1, 40))
    _opt(d, body, "logprobs", st.booleans())
    _opt(d, body, "chat_template_kwargs", st.dictionaries(st.sampled_from(["enable_thinking", "x"]), st.booleans()))
    return body


def _sampling(d: st.DrawFn, body: dict[str, Any]) -> None:
    _opt(d, body, "max_tokens", st.integers(1, 40))
    _opt(d, body, "temperature", st.sampled_from([0, 0.0, 1e-300, 0.7, 2.0]))
    _opt(d, body, "top_p", st.floats(0.01, 1.0))
    _opt(d, body, "top_k", st.integers(-1, 50))
    _opt(d, body, "seed", st.integers(-(2**63), 2**64 - 1))
    _opt(d, body, "stop", plain_text.filter(bool) | st.lists(plain_text.filter(bool), max_size=3))
    _opt(d, body, "stream", st.booleans())
    _opt(d, body, "user", plain_text)


@st.composite
def completion_body(d: st.DrawFn) -> dict[str, Any]:
    prompt = plain_text.filter(bool) | st.lists(st.integers(10, 500), min_size=1, max_size=8)
    body: dict[str, Any] = {"model": "m", "prompt": d(prompt)}
    _sampling(d, body)
    _opt(d, body, "logprobs", st.integers(0, 5))
    return body


@st.composite
def messages_body(d: st.DrawFn, count: bool = False) -> dict[str, Any]:
    blocks = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain_text}), min_size=1, max_size=2)
    turns = d(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                              "content": plain_text | blocks}), min_size=1, max_size=3))
    body: dict[str, Any] = {"model": "m", "messages": turns}
    _opt(d, body, "system", plain_text | blocks)
    _opt(d, body, "thinking", st.sampled_from([{"type": "disabled"}, {"type": "adaptive"},
                                               {"type": "enabled", "budget_tokens": 1024}]))
    if not count:
        body["max_tokens"] = d(st.integers(1, 2000))
        _opt(d, body, "temperature", st.floats(0, 1))
        _opt(d, body, "stop_sequences", st.lists(plain_text.filter(bool), max_size=3))
        _opt(d, body, "stream", st.booleans())
        _opt(d, body, "metadata", st.fixed_dictionaries({"user_id": plain_text}))
    return body


slot_body = st.fixed_dictionaries({"filename": plain_text})
ROUTES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    CHAT: chat_body(), COMPLETIONS: completion_body(), MSGS: messages_body(), COUNT: messages_body(count=True),
    "/slots/0?action=save": slot_body, "/slots/1?action=restore": slot_body,
    "/conversations/0?action=save": slot_body,
}


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a body a value could be put."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _put(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return body


@st.composite
def mutated(d: st.DrawFn, body: dict[str, Any]) -> Any:
    for _ in range(d(st.integers(0, 3))):
        paths = list(_paths(body))
        where = d(st.sampled_from(paths[1:] or paths))
        kind = d(st.sampled_from(["value", "deep", "long", "delete", "extra"]))
        if kind == "value":
            body = _put(body, where, d(json_values))
        elif kind == "deep":  # written as text after json.dumps, which cannot nest this deep
            depth = d(st.sampled_from([2, 63, 64, 65, 200, 1_000, 5_000, 100_000]))
            body = _put(body, where, f"{DEEP}{d(st.sampled_from('[{'))}{depth}")
        elif kind == "long":
            body = _put(body, where, d(st.sampled_from(["x" * 5_000, "\ud800" * 3, "a" * 2_000 + "\udfff"])))
        elif kind == "delete" and where and isinstance(body, dict):
            parent = body
            for key in where[:-1]:
                parent = parent[key]
            del parent[where[-1]]
        elif kind == "extra" and isinstance(body, dict):
            body[d(any_text)] = d(json_values)
    return body


def _nest(match: re.Match[str]) -> str:
    depth = int(match.group(2))
    if match.group(1) == "[":
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


@st.composite
def requests(d: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    url = d(st.sampled_from(sorted(ROUTES)))
    body = d(mutated(d(ROUTES[url])))
    text = json.dumps(body).replace(f'"{HUGE}"', "9" * d(st.sampled_from([40, 41, 4_301, 10_000])))
    text = re.sub('"' + DEEP + r'([\[{])([0-9]+)"', _nest, text)
    raw = text.encode("utf-8")
    cut = d(st.sampled_from(["none", "none", "none", "truncate", "garbage"]))
    if cut == "truncate":
        raw = raw[: d(st.integers(0, len(raw)))]
    elif cut == "garbage":
        at = d(st.integers(0, len(raw)))
        raw = raw[:at] + d(st.binary(min_size=1, max_size=4)) + raw[at:]
    media = d(st.sampled_from(["application/json"] * 8 + ["text/plain", "application/json; charset=utf-8", ""]))
    return url, raw, ({"content-type": media} if media else {})


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = FakeEngine()
    engine.config.session_dir = "/sessions"
    with TestClient(build_app(engine), raise_server_exceptions=False) as c:
        yield c


def _check_shape(url: str, status: int, body: Any) -> None:
    if url.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


@settings(max_examples=max(CI_EXAMPLES, settings.default.max_examples), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much, HealthCheck.large_base_example])
@given(case=requests())
def test_no_request_gets_a_5xx(client: TestClient, case: tuple[str, bytes, dict[str, str]]) -> None:
    url, raw, headers = case
    r = client.post(url, content=raw, headers=headers)
    event(f"status {r.status_code}")  # the spread of answers, shown by --hypothesis-show-statistics
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        _check_shape(url.split("?")[0], r.status_code, r.json())
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert "server_error" not in r.text and '"api_error"' not in r.text
    assert client.get("/health").status_code == 200


def test_the_server_answers_after_the_fuzzing(client: TestClient) -> None:
    r = client.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "You said: hi."
