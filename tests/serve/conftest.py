"""A real uvicorn server in a thread over the fake engine, shared by a test module.

A real socket (not an in-process transport) so the SDKs, SSE framing and
client disconnects behave exactly as they do against `strata serve`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import uvicorn
from fake_engine import FakeEngine

from strata.serve import build_app

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_health(url: str, timeout: float, status: str = "ok") -> bool:
    """Poll a server process's /health until it reports `status` ("ok", or "loading" while the
    model loads); False when it did not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).json().get("status") == status:
                return True
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.1)
    return False


class ServerThread:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[ServerThread]:
    with ServerThread(build_app(engine)) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _fresh_engine(request: pytest.FixtureRequest) -> None:
    """Each test starts with default knobs, whatever the previous one set."""
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine").reset()


@pytest.fixture
def oai(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture
def claude(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=20)


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=20) as client:
        yield client
