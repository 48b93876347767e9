"""llama.cpp's llama-server as a peer in a replayed workload: started on a GGUF, fed token ids.

The benchmarks send it the same token ids they send Strata, through its
native `/completion` route (`prompt` as token ids, streamed, greedy), and
time each request to its first streamed token; `timings.cache_n` says how
many prompt tokens it reused.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any, Callable

import httpx

Send = Callable[[list[int], list[int]], tuple[float, int, list[int]]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stream_completion(url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The events of one streamed request to llama-server's /completion, as it sends them."""
    with httpx.stream("POST", f"{url}/completion", json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[6:])


class LlamaServer:
    """`llama-server -m MODEL -np 2 -c 2*CTX` with `extra` flags, for as long as the `with` lasts."""

    def __init__(self, binary: str, model: str, context: int, extra: list[str], lanes: int = 2,
                 threads: int | None = None) -> None:
        self.port = free_port()
        self.command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                        "-np", str(lanes), "-c", str(lanes * context), "--no-webui", *extra]
        if threads is not None:
            self.command += ["-t", str(threads)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.stderr else ""
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {err}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("llama-server did not become ready in 300 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def sender(self, n_predict: int, cache_prompt: bool) -> Send:
        """Requests timed to their first streamed token: (ttft s, reused prompt tokens, answer ids).
        The cut points Strata is given have no llama-server field: it places its own checkpoints."""

        def send(prompt: list[int], cuts: list[int]) -> tuple[float, int, list[int]]:
            body: dict[str, Any] = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                                    "top_k": 1, "cache_prompt": cache_prompt, "stream": True,
                                    "return_tokens": True, "ignore_eos": True}
            started = time.perf_counter()
            ttft, answer, cached = None, [], 0
            for ev in stream_completion(self.url, body):
                if ev.get("tokens") and ttft is None:
                    ttft = time.perf_counter() - started
                answer += ev.get("tokens", [])
                if ev.get("stop"):
                    cached = int(ev.get("timings", {}).get("cache_n", 0))
            return ttft or 0.0, cached, answer

        return send
