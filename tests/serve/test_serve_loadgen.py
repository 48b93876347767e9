"""The load benchmark's arithmetic against the fake engine (figures, not speed)."""

from __future__ import annotations

import asyncio

from conftest import ServerThread
from fake_engine import FakeEngine
from strata.serve.loadgen import run


def test_loadgen_counts_requests_tokens_and_ttft(server: ServerThread, engine: FakeEngine) -> None:
    result = asyncio.run(run(server.url, clients=3, seconds=0.4, max_tokens=5, api_key=None))
    assert result["errors"] == {}
    assert result["requests"] >= 3
    assert result["generated_tokens"] == 5 * result["requests"]
    assert 0 < result["ttft_p50_s"] <= result["ttft_p99_s"]
    assert len(engine.calls) == result["requests"]


def test_loadgen_reports_refusals(server: ServerThread, engine: FakeEngine) -> None:
    from strata.errors import KvPoolFull

    engine.refuse = KvPoolFull("full")
    result = asyncio.run(run(server.url, clients=2, seconds=0.2, max_tokens=5, api_key=None))
    assert result["requests"] == 0 and result["errors"].get("503", 0) >= 2
