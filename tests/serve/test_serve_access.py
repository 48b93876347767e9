"""Who may drive the server: API keys as UTF-8 bytes, empty keys refused, public binds warned, CORS."""

from __future__ import annotations

import argparse
import logging

import pytest
from fake_engine import FakeEngine
from starlette.testclient import TestClient

from strata.serve import build_app
from strata.serve.main import add_serve_arguments, run_server
from strata.serve.security import api_key_problem, bind_warning, is_loopback

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
ORIGIN = "http://localhost:3000"


def test_a_non_ascii_key_matches_as_utf8_bytes() -> None:
    key = "clé-秘密"
    with TestClient(build_app(FakeEngine(), api_key=key)) as c:
        assert c.post(CHAT, json=BODY, headers={"x-api-key": key.encode("utf-8")}).status_code == 200
        assert c.post(CHAT, json=BODY, headers={"authorization": b"Bearer " + key.encode("utf-8")}).status_code == 200
        assert c.post(CHAT, json=BODY, headers={"x-api-key": key.encode("latin-1", "replace")}).status_code == 401
        assert c.post(CHAT, json=BODY, headers={"x-api-key": b"cl\xe9"}).status_code == 401


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_key_is_refused(key: str) -> None:
    assert api_key_problem(key) is not None and api_key_problem("k") is None and api_key_problem(None) is None
    with pytest.raises(ValueError, match="empty API key"):
        build_app(FakeEngine(), api_key=key)


def test_strata_serve_refuses_an_empty_key_before_loading(caplog: pytest.LogCaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--api-key", ""])
    args.model = "/nonexistent/model.gguf"  # never read: the key is refused first
    with caplog.at_level(logging.ERROR, logger="strata.serve"):
        assert run_server(args) == 2
    assert "API key is empty" in caplog.text


@pytest.mark.parametrize("host, public", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                          ("[::1]", False), ("127.8.9.1", False), ("0.0.0.0", True),
                                          ("::", True), ("192.168.1.5", True), ("example.com", True)])
def test_public_binds_without_a_key_warn_in_one_line(host: str, public: bool) -> None:
    assert is_loopback(host) is not public
    warning = bind_warning(host, None)
    assert (warning is not None) is public
    if warning:
        assert "\n" not in warning and host in warning and "--api-key" in warning
    assert bind_warning(host, "key") is None


def test_without_cors_origins_no_cors_header_is_sent() -> None:
    with TestClient(build_app(FakeEngine())) as c:
        pre = c.options(CHAT, headers={"origin": ORIGIN, "access-control-request-method": "POST",
                                       "access-control-request-headers": "content-type"})
        assert "access-control-allow-origin" not in pre.headers
        r = c.post(CHAT, json=BODY, headers={"origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        plain = c.post(CHAT, content=b'{"messages": []}', headers={"origin": ORIGIN, "content-type": "text/plain"})
        assert plain.status_code == 415


def test_configured_origins_get_preflights_and_headers_before_auth() -> None:
    app = build_app(FakeEngine(), api_key="k", cors_origins=[ORIGIN])
    with TestClient(app) as c:
        pre = c.options(CHAT, headers={"origin": ORIGIN, "access-control-request-method": "POST",
                                       "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = c.post(CHAT, json=BODY, headers={"origin": ORIGIN, "authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        other = c.options(CHAT, headers={"origin": "http://evil.example", "access-control-request-method": "POST"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_a_bad_key_is_an_authentication_error_as_llama_server_names_it() -> None:
    """llama-server's `type` beside OpenAI's fields, so both kinds of client read it."""
    with TestClient(build_app(FakeEngine(), api_key="k")) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = c.post(CHAT, json=BODY, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"] == {"type": "authentication_error", "code": "invalid_api_key", "param": None,
                                         "message": r.json()["error"]["message"]}
            assert "API key" in r.json()["error"]["message"]


def test_preflights_need_no_key_but_the_request_still_does() -> None:
    preflight = {"origin": ORIGIN, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    with TestClient(build_app(FakeEngine(), api_key="k", cors_origins=[ORIGIN])) as c:
        for path in (CHAT, "/completion", "/slots/0", "/apply-template"):
            pre = c.options(path, headers=preflight)
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN, path
        r = c.post(CHAT, json=BODY, headers={"origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN  # readable by the page
        assert r.json()["error"]["type"] == "authentication_error"
    with TestClient(build_app(FakeEngine(), api_key="k")) as c:  # no --cors-origin: no CORS, still no 401
        pre = c.options(CHAT, headers=preflight)
        assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
        assert c.post(CHAT, json=BODY).status_code == 401
