"""The shared body checks on every route: limits, surrogates, long numbers, depth, media type."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from starlette.testclient import TestClient

from strata.serve import build_app
from strata.serve.limits import LIMITS

JSON = {"content-type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS, MSGS, COUNT = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"
BASES = {
    CHAT: {"model": "m", "messages": USER, "max_tokens": 3},
    COMPLETIONS: {"model": "m", "prompt": "hi", "max_tokens": 3},
    MSGS: {"model": "m", "messages": USER, "max_tokens": 3},
    COUNT: {"model": "m", "messages": USER},
    "/slots/0?action=save": {"filename": "a.bin"},
    "/conversations/0?action=save": {"filename": "a.bin"},
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = FakeEngine()
    engine.config.session_dir = "/sessions"
    with TestClient(build_app(engine)) as c:
        yield c


def error(r, status: int, param: str | None = None) -> str:
    """The error's message, after checking the status and the route's error shape."""
    assert r.status_code == status, r.text
    body = r.json()
    if r.request.url.path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        if param is not None:
            assert f"'{param}'" in body["error"]["message"], body
        return body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]["message"]


def post_raw(client: TestClient, url: str, text: str):
    return client.post(url, content=text.encode("utf-8"), headers=JSON)


@pytest.mark.parametrize("url, body, param", [
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content[0].text"),
    (CHAT, {"model": "m", "messages": USER, "stop": ["\ud83d"]}, "stop[0]"),
    (COMPLETIONS, {"model": "m", "prompt": "x\udc00"}, "prompt"),
    (MSGS, {"model": "m", "max_tokens": 3, "messages": USER, "system": [{"type": "text", "text": "\ud800"}]},
     "system[0].text"),
    (MSGS, {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content"),
    (COUNT, {"model": "m", "messages": USER, "system": "\ud800"}, "system"),
    ("/slots/0?action=restore", {"filename": "\ud800.bin"}, "filename"),
    ("/conversations/0?action=save", {"filename": "a\udfff"}, "filename"),
    (CHAT, {"model": "m", "messages": USER, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs"),
])
def test_lone_surrogates_are_a_400_naming_the_field(client: TestClient, url: str, body: dict, param: str) -> None:
    message = error(post_raw(client, url, json.dumps(body)), 400, param)
    assert "surrogate" in message


@pytest.mark.parametrize("url", list(BASES))
def test_deep_nesting_is_a_400_never_a_recursion_error(client: TestClient, url: str) -> None:
    for depth in (100, 1_000, 100_000):
        error(post_raw(client, url, "[" * depth + "]" * depth), 400)
        body = json.dumps(BASES[url])[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
        error(post_raw(client, url, body), 400, "deep")


@pytest.mark.parametrize("depth", [70, 1_000, 50_000])
def test_deep_chat_template_kwargs_name_the_field(client: TestClient, depth: int) -> None:
    body = json.dumps(BASES[CHAT])[:-1] + ', "chat_template_kwargs": {"a": ' + "[" * depth + "]" * depth + "}}"
    message = error(post_raw(client, CHAT, body), 400)
    assert "chat_template_kwargs" in message and "nested" in message


@pytest.mark.parametrize("url, field", [(CHAT, "max_tokens"), (CHAT, "seed"), (COMPLETIONS, "prompt"),
                                        (MSGS, "max_tokens"), (COUNT, "model")])
def test_integers_of_thousands_of_digits_are_a_400(client: TestClient, url: str, field: str) -> None:
    body = json.dumps(BASES[url])[:-1] + f', "{field}": ' + "9" * 5000 + "}"
    if field == "prompt":
        body = json.dumps({"model": "m"})[:-1] + ', "prompt": [' + "7" * 4400 + "]}"
        field = "prompt[0]"
    error(post_raw(client, url, body), 400, field)


@pytest.mark.parametrize("text, field", [('NaN', "temperature"), ("Infinity", "temperature"), ("1e999", "temperature")])
def test_non_finite_numbers_are_a_400(client: TestClient, text: str, field: str) -> None:
    body = json.dumps(BASES[CHAT])[:-1] + f', "{field}": {text}' + "}"
    error(post_raw(client, CHAT, body), 400, field)


def test_long_ids_in_paths_are_a_400(client: TestClient) -> None:
    error(client.post("/slots/" + "1" * 5000 + "?action=save", json={"filename": "a"}), 400, "id_slot")
    error(client.post("/conversations/" + "1" * 5000 + "?action=save", json={"filename": "a"}), 400, "id")


def test_a_body_over_the_limit_is_a_413_in_both_shapes(client: TestClient) -> None:
    big = b'{"model": "m", "messages": [], "pad": "' + b"x" * LIMITS.body_bytes + b'"}'
    assert "limit" in error(client.post(CHAT, content=big, headers=JSON), 413)
    r = client.post(MSGS, content=big, headers=JSON)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_stop_strings_count_and_length(client: TestClient) -> None:
    many = [f"s{i}" for i in range(LIMITS.stop_strings + 1)]
    assert "limit" in error(client.post(CHAT, json={**BASES[CHAT], "stop": many}), 400, "stop")
    long = "y" * (LIMITS.stop_chars + 1)
    assert "limit" in error(client.post(CHAT, json={**BASES[CHAT], "stop": long}), 400, "stop")
    assert "limit" in error(client.post(COMPLETIONS, json={**BASES[COMPLETIONS], "stop": [long]}), 400, "stop")
    error(client.post(MSGS, json={**BASES[MSGS], "stop_sequences": many}), 400, "stop_sequences")
    ok = client.post(CHAT, json={**BASES[CHAT], "stop": many[:-1], "temperature": 0})
    assert ok.status_code == 200, ok.text


def test_message_count_is_limited(client: TestClient) -> None:
    turns = [{"role": "user", "content": "x"}] * (LIMITS.messages + 1)
    error(client.post(CHAT, json={"model": "m", "messages": turns}), 400, "messages")
    error(client.post(MSGS, json={"model": "m", "max_tokens": 3, "messages": turns}), 400, "messages")


def test_long_strings_arrays_and_objects_are_limited(client: TestClient) -> None:
    huge = "z" * (LIMITS.string_chars + 1)
    error(client.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": huge}]}), 400,
          "messages[0].content")
    ids = [11] * (LIMITS.array_items + 1)
    error(client.post(COMPLETIONS, json={"model": "m", "prompt": ids}), 400, "prompt")
    kwargs = {f"k{i}": i for i in range(LIMITS.object_keys + 1)}
    error(client.post(CHAT, json={**BASES[CHAT], "chat_template_kwargs": kwargs}), 400, "chat_template_kwargs")


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
@pytest.mark.parametrize("url", list(BASES))
def test_bodies_a_page_could_send_unasked_are_refused(client: TestClient, url: str,
                                                      content_type: str | None) -> None:
    """A cross-origin page may POST these types without a preflight: none may drive the server."""
    headers = {} if content_type is None else {"content-type": content_type}
    r = client.post(url, content=json.dumps(BASES[url]).encode(), headers=headers)
    assert "Content-Type must be application/json" in error(r, 415)


def test_json_media_types_with_parameters_pass(client: TestClient) -> None:
    r = client.post(CHAT, content=json.dumps({**BASES[CHAT], "temperature": 0}).encode(),
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_a_block_type_of_the_wrong_type_is_a_400(client: TestClient) -> None:
    """Found by the fuzzer: a list as a block's "type" reached a set lookup (TypeError, 500)."""
    turns = [{"role": "user", "content": [{"type": "text", "text": ""}, {"text": "", "type": []}]}]
    for url in (MSGS, COUNT):
        message = error(client.post(url, json={**BASES[url], "messages": turns}), 400)
        assert "block type [] is not supported" in message
