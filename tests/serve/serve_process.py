"""A real `strata serve` subprocess for tests: start, wait for /health, talk, stop cleanly.

Each process costs a model load, so tests start the ones they need together
and wait only for the one they use next.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
from conftest import free_port

SERVE = [sys.executable, "-m", "strata.cli", "serve"]
GREEDY = {"temperature": 0}


class ServeProcess:
    """One server; its output goes to `<logs>/<name>.log`, shown when it fails to start."""

    def __init__(self, name: str, args: list[str], logs: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{name}.log"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen([*SERVE, "--port", str(self.port), "--threads", "1", *args],
                                     stdout=self._out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ready = False
        self.terminated = False

    def wait_ready(self, timeout: float = 240) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while not self.ready:
            assert self.proc.poll() is None, f"server exited:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not ready:\n{self.log.read_text()[-3000:]}"
            try:
                self.ready = httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        return self

    def terminate(self) -> None:
        """One SIGTERM: a second one during shutdown would (rightly) kill the process."""
        if not self.terminated:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> str:
        self.terminate()
        self.proc.wait(timeout=60)
        self._out.close()
        return self.log.read_text()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.MULTILINE)}

    def oai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)

    def claude(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0, timeout=120)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)
