"""A load benchmark for a running server (not a test): `python -m strata.serve.loadgen`.

N clients each stream chat completions back to back for M seconds; the JSON
printed at the end gives requests/s, time to first token (p50/p99) and
generated tokens/s, measured as a client sees them (SSE over HTTP).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three facts about the Moon.",
    "What is the capital of France?",
]


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    done: int = 0
    errors: dict[str, int] = field(default_factory=dict)


async def _one(client: httpx.AsyncClient, prompt: str, max_tokens: int, tally: Tally) -> None:
    body = {
        "model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            tally.errors[str(r.status_code)] = tally.errors.get(str(r.status_code), 0) + 1
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                first = time.monotonic() - t0
            if chunk.get("usage"):
                tally.tokens += chunk["usage"]["completion_tokens"]
    if first is not None:
        tally.ttft.append(first)
    tally.done += 1


async def _client(url: str, index: int, deadline: float, max_tokens: int, tally: Tally,
                  headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=None, headers=headers) as client:
        n = index
        while time.monotonic() < deadline:
            try:
                await _one(client, PROMPTS[n % len(PROMPTS)], max_tokens, tally)
            except httpx.HTTPError as exc:
                tally.errors[type(exc).__name__] = tally.errors.get(type(exc).__name__, 0) + 1
            n += 1


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def run(url: str, clients: int, seconds: float, max_tokens: int, api_key: str | None) -> dict:
    tally = Tally()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    await asyncio.gather(*(_client(url, i, start + seconds, max_tokens, tally, headers)
                           for i in range(clients)))
    wall = time.monotonic() - start
    return {
        "url": url, "clients": clients, "seconds": round(wall, 2), "max_tokens": max_tokens,
        "requests": tally.done, "requests_per_s": round(tally.done / wall, 3),
        "ttft_p50_s": _percentile(tally.ttft, 50), "ttft_p99_s": _percentile(tally.ttft, 99),
        "generated_tokens": tally.tokens, "tokens_per_s": round(tally.tokens / wall, 2),
        "errors": tally.errors,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m strata.serve.loadgen", description=__doc__)
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--api-key", default=None)
    a = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(a.url, a.clients, a.seconds, a.max_tokens, a.api_key)), indent=2))


if __name__ == "__main__":
    main()
