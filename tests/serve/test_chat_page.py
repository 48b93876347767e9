"""The chat page at `/`: its files over HTTP, its key rules, and the page itself in headless chromium.

The browser tests drive the page as a user would (type, press Enter, click
Stop) against the fake engine behind a key, then once against `strata serve`
on the default model, which must answer "Paris"; that one leaves a screenshot
in its artifacts folder. Without chromium or playwright they are skipped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import headless_chromium
from conftest import ServerThread, free_port, wait_for_health
from fake_engine import WORDS, FakeEngine
from serve_process import ServeProcess
from starlette.testclient import TestClient

from strata.serve import build_app
from strata.serve.chat_page import PAGE_FILES

KEY = "page-key"
CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
STATIC = Path(__file__).resolve().parents[2] / "strata" / "serve" / "static"
FAKE_SERVER = Path(__file__).with_name("fake_server.py")
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# ---- over HTTP, no browser ----

def test_the_page_and_its_files_are_served_with_their_types() -> None:
    with TestClient(build_app(FakeEngine())) as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert 'src="static/chat.js"' in page.text and 'href="static/chat.css"' in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        js, css = c.get("/static/chat.js"), c.get("/static/chat.css")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        assert js.content == (STATIC / "chat.js").read_bytes() and b"v1/chat/completions" in js.content
        assert c.get("/static/missing.js").status_code == 404  # only the page's own files
        assert c.get("/static/../app.py").status_code == 404


def test_the_page_loads_nothing_from_elsewhere() -> None:
    """No CDN: the page has to work on a machine that reaches nothing but this server."""
    for name in ("index.html", "chat.js", "chat.css"):
        text = (STATIC / name).read_text()
        assert not re.search(r"(https?:)?//[\w.-]+\.[a-z]{2,}/", text), name  # no address of another host
        assert "import(" not in text and "@import" not in text and "innerHTML" not in text, name


def test_the_page_is_public_but_the_api_keeps_its_key() -> None:
    with TestClient(build_app(FakeEngine(), api_key=KEY)) as c:
        for page in PAGE_FILES:
            assert c.get(page.path).status_code == 200, page.path
        assert c.post(CHAT, json=BODY).status_code == 401
        assert c.post(CHAT, json=BODY, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert c.post(CHAT, json=BODY, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert c.get("/v1/models").status_code == 401  # the page's status line asks with the key
        assert c.post("/", json=BODY).status_code == 405  # open, but only GET has a handler


def test_without_the_page_its_paths_are_like_any_unknown_path() -> None:
    with TestClient(build_app(FakeEngine(), chat_page=False)) as c:
        for page in PAGE_FILES:
            r = c.get(page.path)
            assert r.status_code == 404 and "No such endpoint" in r.json()["error"]["message"], page.path
        assert c.post(CHAT, json=BODY).status_code == 200
    with TestClient(build_app(FakeEngine(), api_key=KEY, chat_page=False)) as c:
        assert c.get("/").status_code == 401  # no longer an open path


def test_the_static_files_are_package_data() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((STATIC.parents[2] / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["strata"]
    shipped = {p.name for pattern in patterns for p in (STATIC.parents[1]).glob(pattern)}
    assert {page.name for page in PAGE_FILES} <= shipped
    assert {p.name for p in STATIC.iterdir()} == {page.name for page in PAGE_FILES}


def test_no_webui_serves_the_api_without_the_page() -> None:
    """The flag through the real `strata serve` entry point (the fake engine behind it)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(FAKE_SERVER), "--port", str(port), "--no-webui"],
                            env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for_health(url, 60)
        assert httpx.get(f"{url}/").status_code == 404
        assert httpx.get(f"{url}/static/chat.js").status_code == 404
        assert httpx.post(f"{url}{CHAT}", json=BODY).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


# ---- in the browser, over the fake engine ----

@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(max_context=16384)  # room for the tool instruction: its tokens are characters


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[ServerThread]:
    with ServerThread(build_app(engine, api_key=KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as b:
        yield b


def _open(browser: Any, url: str) -> tuple[Any, Any, list[str]]:
    """A fresh browser profile (empty localStorage) on the page; uncaught page errors collected."""
    context = browser.new_context(viewport={"width": 1100, "height": 720})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{url}/")
    return context, page, errors


@pytest.fixture
def page(browser: Any, server: ServerThread, engine: FakeEngine) -> Iterator[Any]:
    context, pg, errors = _open(browser, server.url)
    pg.fill("#api-key", KEY)
    pg.fill("#temperature", "0")  # the fake's greedy answers repeat the message
    yield pg
    context.close()
    assert errors == []


def _send(page: Any, text: str) -> None:
    """Type and press Enter, then wait for the answer to end (the page says when it is idle)."""
    page.fill("#message", text)
    page.press("#message", "Enter")
    page.wait_for_selector('body[data-state="idle"]', timeout=30_000)


def _texts(page: Any, selector: str) -> list[str]:
    return list(page.locator(selector).all_text_contents())


def _wait(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def test_an_answer_streams_in_and_the_key_is_sent(page: Any, engine: FakeEngine) -> None:
    from playwright.sync_api import expect

    page.fill("#api-key", "")  # no key: the server refuses, the page says why and keeps the text
    _send(page, "hi")
    expect(page.locator(".msg.error .content")).to_contain_text("401")
    assert page.input_value("#message") == "hi" and engine.calls == []
    page.fill("#api-key", KEY)
    page.press("#api-key", "Tab")  # the change event: the status line asks again, with the key
    expect(page.locator("#status")).to_have_text("model: fake-model")
    _send(page, "hi")
    assert _texts(page, ".msg.user .content") == ["hi"]
    assert _texts(page, ".msg.assistant .content") == ["You said: hi."]
    assert "stop" in page.text_content(".msg.assistant .meta")
    assert len(engine.calls) == 1


def test_settings_reach_the_request(page: Any, engine: FakeEngine) -> None:
    page.fill("#system", "Answer briefly.")
    page.fill("#temperature", "0.5")
    page.fill("#top-p", "0.9")
    page.fill("#max-tokens", "40")
    page.fill("#stop", "zz\nSTOP")
    _send(page, "hello")
    params = engine.calls[-1][1]
    assert (params.temperature, params.top_p, params.max_tokens, params.stop) == (0.5, 0.9, 40, ["zz", "STOP"])
    messages = engine.tokenizer.template_calls[-1]["messages"]
    assert messages[0] == {"role": "system", "content": "Answer briefly."}
    for field in ("#system", "#temperature", "#top-p", "#max-tokens", "#stop"):
        page.fill(field, "")
    _send(page, "hello")  # emptied settings are left to the server's defaults
    params = engine.calls[-1][1]
    assert params.temperature != 0.5 and params.max_tokens != 40 and params.stop == []
    assert engine.tokenizer.template_calls[-1]["messages"][0]["role"] == "user"


def test_a_refused_setting_is_shown_with_its_field(page: Any, engine: FakeEngine) -> None:
    page.fill("#temperature", "5")
    _send(page, "hi")
    assert "temperature" in page.text_content(".msg.error .content")
    assert engine.calls == [] and page.locator(".msg.assistant").count() == 0
    page.fill("#max-tokens", "2.5")  # caught in the page, naming the field, before any request
    _send(page, "hi")
    assert "max_tokens" in page.text_content("#notice") and engine.calls == []


def test_stop_aborts_the_stream_and_keeps_what_came(page: Any, engine: FakeEngine) -> None:
    from playwright.sync_api import expect

    engine.delay = 0.05  # about 18 s for the whole LONG answer
    page.fill("#message", "LONG")
    page.press("#message", "Enter")
    expect(page.locator(".msg.assistant .content")).to_contain_text("alpha", timeout=10_000)
    page.click("#stop-button")
    page.wait_for_selector('body[data-state="idle"]', timeout=10_000)
    assert "stopped" in page.text_content(".msg.assistant .meta")
    shown = page.text_content(".msg.assistant .content")
    assert 0 < len(shown) < len(" ".join(WORDS * 6))
    _wait(lambda: len(engine.cancels) == 1)  # the server saw the client leave and freed the lane


def test_the_conversation_survives_a_reload_and_clear_forgets_it(page: Any, engine: FakeEngine) -> None:
    _send(page, "one")
    page.reload()
    assert _texts(page, ".msg .content") == ["one", "You said: one."]
    assert page.input_value("#api-key") == KEY  # kept too
    _send(page, "two")
    history = engine.tokenizer.template_calls[-1]["messages"]
    assert [(m["role"], m["content"]) for m in history] == [
        ("user", "one"), ("assistant", "You said: one."), ("user", "two")]
    page.click("#clear")
    assert page.locator(".msg").count() == 0
    page.reload()
    assert page.locator(".msg").count() == 0
    assert json.loads(page.evaluate("localStorage.getItem('strata.chat.messages')")) == []


def test_reasoning_is_shown_apart_from_the_answer(page: Any, engine: FakeEngine) -> None:
    _send(page, "MARKS THINKING")
    assert page.text_content(".msg.assistant .reasoning-text") == "I mark my own thoughts."
    assert "mark my own" not in page.text_content(".msg.assistant .content")
    assert page.is_visible(".msg.assistant .reasoning")
    _send(page, "plain")
    assert page.locator(".msg.assistant").nth(1).locator(".reasoning").is_hidden()  # nothing to show


def test_tool_calls_are_shown_as_blocks_and_kept_in_the_history(page: Any, engine: FakeEngine) -> None:
    page.fill("#tools", "[not json")
    _send(page, "Weather in Paris?")
    assert "tools: not JSON" in page.text_content("#notice") and engine.calls == []
    page.fill("#tools", json.dumps(WEATHER_TOOL))
    engine.reply = "Let me look. " + CALL
    _send(page, "Weather in Paris?")
    assert page.text_content(".msg.assistant .content") == "Let me look."
    assert page.text_content(".tool-call .tool-name") == "tool call: get_weather"
    assert json.loads(page.text_content(".tool-call .tool-args")) == {"city": "Paris"}
    assert "tool_calls" in page.text_content(".msg.assistant .meta")
    engine.reply = "Fine."
    _send(page, "Thanks")
    assistant = engine.tokenizer.template_calls[-1]["messages"]
    assert "get_weather" in json.dumps(assistant) and page.locator(".msg.assistant").count() == 2


def test_model_output_is_text_never_markup(page: Any, engine: FakeEngine) -> None:
    engine.reply = '<img src=x onerror="document.title=\'owned\'"><b>bold</b>'
    _send(page, "hi")
    assert page.text_content(".msg.assistant .content") == engine.reply
    assert page.locator(".msg.assistant .content b, .msg.assistant .content img").count() == 0
    assert page.title() == "Strata chat"


# ---- in the browser, over `strata serve` on the default model ----

@pytest.mark.slow
def test_the_default_model_answers_paris_in_the_page(browser: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    srv = ServeProcess("chat-page", ["--api-key", KEY, "--max-context", "1024"], artifacts)
    try:
        srv.wait_ready()
        context, page, errors = _open(browser, srv.url)
        page.fill("#api-key", KEY)
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "48")
        _send(page, "What is the capital of France?")
        shot = artifacts / "chat-page-paris.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"chat page screenshot: {shot}")
        answer = page.text_content(".msg.assistant .content")
        assert "Paris" in answer, answer
        assert "London" not in answer
        page.reload()  # the answer was kept, and the status line names the model
        assert _texts(page, ".msg.assistant .content") == [answer]
        expect(page.locator("#status")).to_contain_text("model: SmolLM2")
        context.close()
        assert errors == []
    finally:
        log = srv.stop()
    assert srv.proc.returncode == 0, log[-3000:]
    assert "POST /v1/chat/completions 200" in log
