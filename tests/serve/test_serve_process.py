"""The `strata serve` process: background load behind /health, logging, signals, exit status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import free_port, wait_for_health

FAKE_SERVER = Path(__file__).with_name("fake_server.py")


def start(port: int, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(FAKE_SERVER), "--port", str(port), "--max-context", "512", "--parallel", "3"],
        env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def test_health_loading_then_serving_then_clean_sigterm() -> None:
    port = free_port()
    proc = start(port, FAKE_LOAD_S="1.5")
    url = f"http://127.0.0.1:{port}"
    try:
        statuses = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{url}/health", timeout=1)
                statuses.append(r.json()["status"])
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        assert statuses[0] == "loading" and statuses[-1] == "ok"
        state = httpx.get(f"{url}/v1/state").json()
        assert state["max_context"] == 512 and len(state["stats"]["chunks_per_session"]) == 3
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "POST /v1/chat/completions 200" in out
    assert "fake engine closed" in out


def test_load_failure_exits_1_with_the_reason() -> None:
    proc = start(free_port(), FAKE_LOAD_FAIL="1")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    assert "could not load the model" in out and "not a GGUF file" in out


def test_sigint_while_loading_exits_130_in_one_line() -> None:
    """Stopped before the model is loaded: the loading thread is left (it may be in native code,
    which an interpreter shutting down around it would abort), with one line and status 130."""
    port = free_port()
    proc = start(port, FAKE_LOAD_S="30")
    assert wait_for_health(f"http://127.0.0.1:{port}", 20, "loading")  # it answers before the signal
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130, out
    assert "stopped while the model was loading" in out and "Traceback" not in out
    assert "fake engine closed" not in out and time.monotonic() - started < 10


def test_sigint_mid_stream_ends_the_stream_with_a_last_event() -> None:
    """The real server on the default model: long streams on each API get their last lines when the
    server is told to stop (OpenAI: the error event with code `cancelled`, then `[DONE]`;
    Anthropic: its `error` event; llama-server's /completion: an error line), and the process
    exits 0 with no traceback."""
    import json
    import threading

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--parallel", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    story = [{"role": "user", "content": "Write a very long story."}]
    bodies = {"/v1/chat/completions": {"messages": story, "max_tokens": 3000, "seed": 1},
              "/v1/messages": {"model": "m", "messages": story, "max_tokens": 3000},
              "/completion": {"prompt": "Once upon a time", "n_predict": 3000, "seed": 1}}
    lines: dict[str, list[str]] = {path: [] for path in bodies}
    started = {path: threading.Event() for path in bodies}

    def client(path: str) -> None:
        body = {**bodies[path], "stream": True, "temperature": 0.8}
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines[path].append(line)
                    if '"content"' in line or "text_delta" in line:
                        started[path].set()  # text is flowing: the request holds a lane

    try:
        assert wait_for_health(url, 120)
        readers = [threading.Thread(target=client, args=(path,)) for path in bodies]
        for reader in readers:
            reader.start()
        assert all(event.wait(60) for event in started.values()), {p: got[:3] for p, got in lines.items()}
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        for reader in readers:
            reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in out, out
    chat, claude, llama = (lines[path] for path in bodies)
    assert chat[-1] == "data: [DONE]", chat[-3:]
    assert json.loads(chat[-2].removeprefix("data: "))["error"]["code"] == "cancelled"
    assert claude[-2] == "event: error" and "cancelled" in json.loads(claude[-1][6:])["error"]["message"]
    assert json.loads(llama[-1].removeprefix("data: "))["error"]["code"] == "cancelled"
    assert time.monotonic() - stopped < 10
