"""A soak run (not a test): streaming clients that leave at random, then the server must be clean.

    python -m benchmarks.soak --clients 8 --minutes 10 -- --parallel 4 --kv-pool-tokens 16384

starts `python -m strata.serve` with the flags after `--` (or talks to `--url`
with `--pid` for its memory), runs N clients for M minutes (each streams chat
or messages requests back to back, continues its conversation or starts a new
one, and drops the connection part-way through about a third of them), then
waits for the engine to settle and checks, from `/v1/state`:

- every lane is idle and nothing is queued;
- no lane holds a chunk without holding a conversation (a shared pool), and
  the pool's used cells are exactly the chunks the lanes hold;
- the server's resident memory (VmRSS) grew by less than `--rss-bound-mib`
  from the end of the warm-up to the end of the run.

It prints one JSON object with the figures and exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from strata.knobs import text

TOPICS = ["the sea", "hash tables", "the Moon", "France", "bread", "rain", "chess", "trains", "owls"]


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    transport_errors: dict[str, int] = field(default_factory=dict)

    def status(self, code: int) -> None:
        self.statuses[str(code)] = self.statuses.get(str(code), 0) + 1


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _request(rng: random.Random, history: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
    """A streaming request on either API, continuing `history` (which it extends)."""
    history.append({"role": "user", "content": f"Tell me something about {rng.choice(TOPICS)}."})
    max_tokens = rng.randint(4, 48)
    if rng.random() < 0.5:
        return "/v1/chat/completions", {"model": "m", "messages": history, "max_tokens": max_tokens,
                                        "temperature": rng.choice([0, 0.7]), "stream": True}
    return "/v1/messages", {"model": "m", "messages": history, "max_tokens": max_tokens, "stream": True}


async def _one(client: httpx.AsyncClient, rng: random.Random, history: list[dict[str, str]],
               tally: Tally) -> None:
    path, body = _request(rng, history)
    leave_after = rng.randint(1, 12) if rng.random() < 0.35 else None  # lines read before leaving
    tally.requests += 1
    text: list[str] = []
    async with client.stream("POST", path, json=body) as r:
        tally.status(r.status_code)
        if r.status_code != 200:
            await r.aread()
            history.pop()
            return
        lines = 0
        async for line in r.aiter_lines():
            lines += 1
            if leave_after is not None and lines >= leave_after:
                tally.disconnected += 1  # leaving the block closes the connection mid-stream
                history.pop()
                return
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
                delta = event.get("delta", {})
                if event.get("type") == "content_block_delta" and delta.get("type") == "text_delta":
                    text.append(delta["text"])
    tally.completed += 1
    history.append({"role": "assistant", "content": "".join(text) or "ok"})


async def _client(url: str, seed: int, deadline: float, tally: Tally, headers: dict[str, str]) -> None:
    rng = random.Random(seed)
    history: list[dict[str, str]] = []
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as client:
        while time.monotonic() < deadline:
            if len(history) > 8 or rng.random() < 0.2:
                history = []  # a new conversation
            try:
                await _one(client, rng, history, tally)
            except httpx.HTTPError as exc:
                name = type(exc).__name__
                tally.transport_errors[name] = tally.transport_errors.get(name, 0) + 1
                history.clear()


async def _clients(url: str, n: int, seconds: float, tally: Tally, headers: dict[str, str]) -> None:
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(_client(url, seed, deadline, tally, headers) for seed in range(n)))


def _state(url: str, headers: dict[str, str]) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/state", headers=headers, timeout=30).json()["stats"]


def settle(url: str, headers: dict[str, str], timeout: float = 60) -> dict[str, Any]:
    """The engine's stats once no lane is busy and nothing is queued (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _state(url, headers)
        if stats["lanes_busy"] == 0 and stats["queue_length"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def checks(stats: dict[str, Any], rss_growth: int | None, bound: int) -> dict[str, bool]:
    lanes = stats["lanes"]
    held_chunks = sum(lane["chunks"] for lane in lanes)
    out = {
        "lanes_idle": stats["lanes_busy"] == 0 and all(lane["state"] != "busy" for lane in lanes),
        "queue_empty": stats["queue_length"] == 0,
        "pool_cells_match_lane_chunks": stats["pool_cells_used"] == held_chunks * stats["kv_chunk"],
    }
    if stats["pool_shared"]:  # with one range per lane every lane owns its chunks for good
        out["no_chunk_without_conversation"] = all(lane["n_tokens"] > 0 or lane["chunks"] == 0 for lane in lanes)
    if rss_growth is not None:
        out["rss_growth_within_bound"] = rss_growth < bound
    return out


def _start(port: int, flags: list[str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen([sys.executable, "-m", "strata.serve", "--port", str(port), *flags],
                            stdout=out, stderr=subprocess.STDOUT)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def _first_request(url: str, headers: dict[str, str]) -> float:
    """One request before the clients start: the engine's first step is slow (about two
    minutes on the CPU, measured), and clients timing out on it would only test the timeout."""
    t0 = time.monotonic()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=900).raise_for_status()
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0, help="load before the first RSS reading")
    p.add_argument("--rss-bound-mib", type=float, default=64.0, help="allowed RSS growth after the warm-up")
    p.add_argument("--url", help="a running server (default: start one with the flags after --)")
    p.add_argument("--pid", type=int, help="the running server's process id, for its memory")
    p.add_argument("--port", type=int, default=8093)
    p.add_argument("--api-key", default=text("STRATA_API_KEY"), help="the server's key (default: $STRATA_API_KEY)")
    p.add_argument("--log", default="soak-server.log", help="the started server's output")
    a = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    proc = None if a.url else _start(a.port, server_flags, Path(a.log))
    url = a.url or f"http://127.0.0.1:{a.port}"
    pid = a.pid if a.url else proc.pid  # type: ignore[union-attr]
    tally = Tally()
    try:
        _wait_healthy(url, proc)
        first_s = _first_request(url, headers)
        t0 = time.monotonic()
        warmup = min(a.warmup_s, a.minutes * 60 / 4)
        asyncio.run(_clients(url, a.clients, warmup, tally, headers))
        rss_start = rss_bytes(pid) if pid else None
        asyncio.run(_clients(url, a.clients, a.minutes * 60 - warmup, tally, headers))
        elapsed = time.monotonic() - t0
        stats = settle(url, headers)
        rss_end = rss_bytes(pid) if pid else None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    growth = rss_end - rss_start if rss_start is not None and rss_end is not None else None
    result = checks(stats, growth, int(a.rss_bound_mib * 2**20))
    report = {
        "clients": a.clients, "seconds": round(elapsed, 1), "server_flags": server_flags,
        "first_request_s": round(first_s, 1),
        "requests": tally.requests, "completed": tally.completed, "disconnected": tally.disconnected,
        "statuses": tally.statuses, "transport_errors": tally.transport_errors,
        "rss_mib_after_warmup": None if rss_start is None else round(rss_start / 2**20, 1),
        "rss_mib_end": None if rss_end is None else round(rss_end / 2**20, 1),
        "rss_growth_mib": None if growth is None else round(growth / 2**20, 1),
        "rss_bound_mib": a.rss_bound_mib,
        "final": {k: stats[k] for k in ("lanes_busy", "lanes_idle", "queue_length", "pool_cells_used",
                                        "pool_cells_total", "kv_chunk", "refusals", "truncations",
                                        "evictions", "step_errors")},
        "lanes": stats["lanes"], "checks": result, "ok": all(result.values()),
    }
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
