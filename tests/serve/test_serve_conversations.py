"""Parked conversations over HTTP: list them, save one to a session file."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.serve.app import build_app


@pytest.fixture()
def client(tiny_loaded, tmp_path):
    cfg = EngineConfig(model=tiny_loaded.path, parallel=1, max_context=256,
                       conversation_cache_mib=32, session_dir=str(tmp_path))
    with Engine(cfg, loaded=tiny_loaded) as eng:
        with TestClient(build_app(eng)) as c:
            yield c, tmp_path


def _chat(c: TestClient, text: str) -> None:
    r = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4, "temperature": 0,
                                             "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200


def test_list_and_save_a_parked_conversation(client) -> None:
    c, folder = client
    assert c.get("/conversations").json() == []
    _chat(c, "The first conversation, long enough to matter.")
    _chat(c, "A different one takes the only lane.")
    parked = c.get("/conversations").json()
    assert len(parked) == 1 and parked[0]["n_tokens"] > 0
    r = c.post(f"/conversations/{parked[0]['id']}?action=save", json={"filename": "first"})
    assert r.status_code == 200 and r.json()["n_saved"] == parked[0]["n_tokens"]
    assert (folder / "first").is_file()


def test_bad_conversation_requests_are_400(client) -> None:
    c, _ = client
    r = c.post("/conversations/7?action=save", json={"filename": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "id"
    r = c.post("/conversations/7?action=restore", json={"filename": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "action"
    r = c.post("/conversations/abc?action=save", json={"filename": "x"})
    assert r.status_code == 400
