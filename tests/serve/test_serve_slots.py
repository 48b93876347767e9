"""Slot endpoints, /health of a dead engine and the conversation-cache metrics, on the fake engine.

The fake answers session calls from its lanes' token counts or raises the
engine's real error types, so these tests pin the HTTP side: routes, body and
id checks, and the status, shape and headers each engine error maps to.
"""

from __future__ import annotations

import httpx
import pytest
from fake_engine import FakeEngine
from test_serve_observability import metric

from strata.errors import BadRequest, KvPoolFull, SessionFileError, StrataError

USER = [{"role": "user", "content": "hi"}]


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    return err


def _chat(http: httpx.Client) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


STRATA_FIELDS = ("id", "state", "n_tokens", "chunks")


def _strata(rows: list[dict]) -> list[dict]:
    """Strata's own fields of each /slots row (llama-server's come beside them)."""
    return [{k: row[k] for k in STRATA_FIELDS} for row in rows]


def test_slots_list_states_and_save_restore_answers(http: httpx.Client, engine: FakeEngine) -> None:
    assert _strata(http.get("/slots").json()) == [
        {"id": 0, "state": "empty", "n_tokens": 0, "chunks": 0},
        {"id": 1, "state": "empty", "n_tokens": 0, "chunks": 0},
    ]
    usage = _chat(http)["usage"]
    held = usage["prompt_tokens"] + usage["completion_tokens"]
    slots = _strata(http.get("/slots").json())
    assert slots[0] == {"id": 0, "state": "idle", "n_tokens": held, "chunks": 0}
    assert slots[1]["state"] == "empty"
    engine.config.session_dir = "/sessions"
    r = http.post("/slots/0?action=save", json={"filename": "chat.bin"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["timings"]["save_ms"] >= 0
    del body["timings"]
    assert body == {"id_slot": 0, "filename": "chat.bin", "n_saved": held, "n_written": 100 + 8 * held}
    r = http.post("/slots/1?action=restore", json={"filename": "chat.bin"})
    assert r.status_code == 200, r.text
    assert {k: v for k, v in r.json().items() if k != "timings"} == {
        "id_slot": 1, "filename": "chat.bin", "n_restored": 0, "n_read": 100}
    assert engine.session_calls == [("save", 0, "chat.bin"), ("restore", 1, "chat.bin")]


def test_a_busy_lane_is_listed_busy(http: httpx.Client, engine: FakeEngine) -> None:
    engine.delay = 0.05
    body = {"model": "m", "messages": [{"role": "user", "content": "LONG"}], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        assert [s["state"] for s in http.get("/slots").json()] == ["busy", "empty"]


def test_slots_carry_llama_servers_fields(http: httpx.Client, engine: FakeEngine) -> None:
    """id_task, n_ctx, is_processing, speculative, params and next_token, as llama-server reports them."""
    idle = http.get("/slots").json()
    for row in idle:
        assert row["id_task"] == -1 and row["n_ctx"] == 256 and row["speculative"] is False
        assert row["is_processing"] is False and row["params"] is None
        assert row["next_token"] == {"has_next_token": False, "n_remain": -1, "n_decoded": 0}
    engine.delay = 0.05
    body = {"model": "m", "messages": [{"role": "user", "content": "LONG"}], "stream": True, "max_tokens": 50,
            "temperature": 0.5, "top_k": 7}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
        busy, other = http.get("/slots").json()
        assert busy["is_processing"] is True and other["is_processing"] is False
        assert busy["id_task"] >= 1 and busy["n_prompt_tokens"] == len(engine.calls[-1][0])
        assert busy["params"]["temperature"] == 0.5 and busy["params"]["top_k"] == 7
        assert busy["params"]["n_predict"] == 50
        nt = busy["next_token"]
        assert nt["has_next_token"] is True and nt["n_decoded"] >= 1 and nt["n_remain"] == 50 - nt["n_decoded"]


def test_erase_forgets_an_idle_lanes_conversation(http: httpx.Client, engine: FakeEngine) -> None:
    """No --session-dir needed; no body, or an empty object, as llama-server's scripts send."""
    usage = _chat(http)["usage"]
    held = usage["prompt_tokens"] + usage["completion_tokens"]
    r = http.post("/slots/0?action=erase")
    assert r.status_code == 200, r.text
    assert r.json() == {"id_slot": 0, "n_erased": held}
    assert _strata(http.get("/slots").json())[0] == {"id": 0, "state": "empty", "n_tokens": 0, "chunks": 0}
    assert _chat(http)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # read from token 0
    r = http.post("/slots/1?action=erase", json={})
    assert r.json() == {"id_slot": 1, "n_erased": 0}
    assert engine.session_calls == [("erase", 0, ""), ("erase", 1, "")]


def test_erase_of_a_busy_lane_is_409_and_bad_ids_or_bodies_are_400(http: httpx.Client,
                                                                   engine: FakeEngine) -> None:
    _error(http.post("/slots/2?action=erase"), 400, "id_slot")
    _error(http.post("/slots/0?action=erase", json={"filename": "x"}), 400, "filename")
    _error(http.post("/slots/0?action=erase", json=[1]), 400)
    assert engine.session_calls == []
    engine.delay = 0.05
    body = {"model": "m", "messages": [{"role": "user", "content": "LONG"}], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        err = _error(http.post("/slots/0?action=erase"), 409, "id_slot")
        assert err["code"] == "slot_busy" and "busy" in err["message"]


def test_without_session_dir_the_answer_is_501_naming_the_flag(http: httpx.Client) -> None:
    for action in ("save", "restore"):
        err = _error(http.post(f"/slots/0?action={action}", json={"filename": "x"}), 501)
        assert "--session-dir" in err["message"] and err["code"] == "session_files_disabled"


@pytest.mark.parametrize("url, body, param", [
    ("/slots/0?action=delete", {"filename": "x"}, "action"),
    ("/slots/0", {"filename": "x"}, "action"),
    ("/slots/2?action=save", {"filename": "x"}, "id_slot"),
    ("/slots/-1?action=save", {"filename": "x"}, "id_slot"),
    ("/slots/one?action=save", {"filename": "x"}, "id_slot"),
    ("/slots/0?action=save", {}, "filename"),
    ("/slots/0?action=save", {"filename": 7}, "filename"),
    ("/slots/0?action=save", {"filename": ""}, "filename"),
    ("/slots/0?action=save", {"filename": "x", "path": "/tmp"}, "path"),
])
def test_bad_requests_name_the_field(http: httpx.Client, engine: FakeEngine, url: str, body: dict,
                                     param: str) -> None:
    engine.config.session_dir = "/sessions"
    _error(http.post(url, json=body), 400, param)
    assert engine.session_calls == []  # refused before the engine is asked


def test_a_body_that_is_not_json_is_a_400(http: httpx.Client, engine: FakeEngine) -> None:
    engine.config.session_dir = "/sessions"
    r = http.post("/slots/0?action=save", content=b"filename=x",
                  headers={"content-type": "application/json"})
    assert _error(r, 400)["code"] == "invalid_json"


def test_engine_errors_map_to_status_and_shape(http: httpx.Client, engine: FakeEngine) -> None:
    engine.config.session_dir = "/sessions"
    cases: list[tuple[Exception, int, str | None, str]] = [
        (SessionFileError("/sessions/a", "payload checksum mismatch (file corrupted)"), 400, "filename",
         "invalid_session_file"),
        (BadRequest("invalid session filename '..': use a plain file name", "filename"), 400, "filename",
         "invalid_request"),
        (BadRequest("lane 0 is busy; restore into an idle lane", "id_slot"), 400, "id_slot",
         "invalid_request"),
        (KvPoolFull("KV pool full: restoring 900 tokens needs 2 chunks", retry_after=2.5), 503, None,
         "kv_pool_full"),
        (StrataError("the engine is shutting down"), 503, None, "engine_unavailable"),
    ]
    for exc, status, param, code in cases:
        engine.session_error = exc
        r = http.post("/slots/0?action=restore", json={"filename": "a"})
        err = _error(r, status, param)
        assert err["code"] == code
        if isinstance(exc, SessionFileError):  # the server's folder is not shown to clients
            assert err["message"] == "session file 'a': payload checksum mismatch (file corrupted)"
        else:
            assert err["message"] == str(exc)
        if status == 503:
            assert int(r.headers["retry-after"]) >= (3 if code == "kv_pool_full" else 1)
    engine.session_error = RuntimeError("disk on fire")
    assert _error(http.post("/slots/0?action=save", json={"filename": "a"}), 500)["code"] == "internal_error"
    _chat(http)  # still serving


def test_dead_engine_is_unhealthy_and_refuses_requests(http: httpx.Client, engine: FakeEngine) -> None:
    engine.dead = True
    r = http.get("/health")
    assert r.status_code == 503
    assert r.json()["status"] == "error" and "engine loop has stopped" in r.json()["message"]
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": USER})
    assert _error(r, 503)["code"] == "engine_stopped"
    assert _error(http.get("/slots"), 503)["code"] == "engine_stopped"
    engine.dead = False
    assert http.get("/health").status_code == 200


def test_conversation_cache_figures_are_flat_gauges(http: httpx.Client, engine: FakeEngine) -> None:
    text = http.get("/metrics").text
    assert metric(text, "strata_engine_conversation_cache_enabled") == 0
    assert "strata_engine_conversation_cache_hits" not in text
    figures = {"entries": 2, "bytes": 4096, "hits": 5, "misses": 1, "restores": 4, "incremental_parks": 3,
               "full_parks": 2, "evictions": 1}
    engine.conversation_cache = figures
    text = http.get("/metrics").text
    assert metric(text, "strata_engine_conversation_cache_enabled") == 1
    for key, value in figures.items():
        assert f"# TYPE strata_engine_conversation_cache_{key} gauge" in text
        assert metric(text, f"strata_engine_conversation_cache_{key}") == value
    assert "strata_engine_conversation_cache{" not in text


def test_slot_requests_are_counted_by_route(http: httpx.Client) -> None:
    http.get("/slots")
    http.post("/slots/1?action=save", json={"filename": "x"})
    text = http.get("/metrics").text
    assert metric(text, "strata_requests_total", 'endpoint="/slots",status="200"') >= 1
    assert metric(text, "strata_requests_total", 'endpoint="/slots/{id_slot}",status="501"') >= 1
