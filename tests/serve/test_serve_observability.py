"""/health, /metrics, /v1/state, the request log line, and cancellation on disconnect."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest
from conftest import ServerThread
from fake_engine import FakeEngine

from strata.serve import build_app

USER = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "LONG"}]


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else r"(\{[^}]*\})?") + r" (\S+)"
    m = re.search("^" + pattern + "$", text, re.M)
    assert m is not None, f"{name}{{{labels}}} not in /metrics"
    return float(m.group(m.lastindex or 1))


def wait_for(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_health(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok", "model": "fake-model"}


def test_metrics_show_requests_tokens_latency_and_engine_gauges(http: httpx.Client) -> None:
    before = http.get("/metrics").text
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0})
    usage = r.json()["usage"]
    http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 999})
    text = http.get("/metrics").text
    assert text.startswith("# HELP") and "text/plain" in http.get("/metrics").headers["content-type"]
    ok = 'endpoint="/v1/chat/completions",status="200"'
    bad = 'endpoint="/v1/chat/completions",status="400"'
    assert metric(text, "strata_requests_total", ok) >= 1 and metric(text, "strata_requests_total", bad) >= 1
    grew = metric(text, "strata_prompt_tokens_total") - metric(before, "strata_prompt_tokens_total")
    assert grew == usage["prompt_tokens"]
    grew = metric(text, "strata_generated_tokens_total") - metric(before, "strata_generated_tokens_total")
    assert grew == usage["completion_tokens"]
    assert metric(text, "strata_time_to_first_token_seconds_count") >= 1
    assert metric(text, "strata_inter_token_latency_seconds_count") >= usage["completion_tokens"] - 1
    for gauge in ("lanes_busy", "lanes_idle", "queue_length", "pool_cells_total", "pool_cells_used",
                  "pool_cells_free"):
        metric(text, f"strata_engine_{gauge}")
    assert metric(text, "strata_engine_pool_cells_total") == 4096
    assert metric(text, "strata_engine_chunks_per_session", 'lane="0"') == 0
    for counter in ("prefix_reuse_hits", "prefix_tokens_reused", "refusals", "truncations"):
        metric(text, f"strata_engine_{counter}_total")
    assert metric(text, "strata_engine_pool_shared") == 1  # an unknown key, rendered generically
    assert "kv_format" not in text  # not a number: /v1/state shows it
    assert metric(text, "strata_ready") == 1


def metric_or_zero(text: str, name: str, labels: str) -> float:
    """A labelled series not observed yet is absent from /metrics: read it as 0."""
    m = re.search("^" + re.escape(name + ("{" + labels + "}" if labels else "")) + r" (\S+)$", text, re.M)
    return 0.0 if m is None else float(m.group(1))


def test_vllm_families_count_what_was_sent_and_returned(server: ServerThread, engine: FakeEngine,
                                                        http: httpx.Client) -> None:
    model = 'model_name="fake-model"'
    before = http.get("/metrics").text
    usages = [http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0})
              .json()["usage"] for _ in range(2)]
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 3})
    assert r.json()["choices"][0]["finish_reason"] == "length"
    usages.append(r.json()["usage"])
    body = {"model": "m", "messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    usages.append(json.loads(chunks[-1][len("data: "):])["usage"])
    wait_for(lambda: metric_or_zero(http.get("/metrics").text, "vllm:e2e_request_latency_seconds_count", model)
             == metric_or_zero(before, "vllm:e2e_request_latency_seconds_count", model) + 4)
    text = http.get("/metrics").text

    def grew(name: str, labels: str = model) -> float:
        return metric_or_zero(text, name, labels) - metric_or_zero(before, name, labels)

    prompt, completion = sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)
    assert grew("vllm:prompt_tokens_total") == prompt
    assert grew("vllm:generation_tokens_total") == completion
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert grew(f"vllm:{hist}_count") == 4, hist
    assert grew("vllm:request_prompt_tokens_sum") == prompt
    assert grew("vllm:request_generation_tokens_sum") == completion
    gaps = completion - 4  # every token but each request's first comes after a gap (one token per event)
    assert grew("vllm:inter_token_latency_seconds_count") == gaps
    assert grew("vllm:time_per_output_token_seconds_count") == gaps
    assert grew("strata_inter_token_latency_seconds_count", "") == gaps  # the same observations
    assert grew("vllm:request_success_total", 'finished_reason="stop",' + model) == 3
    assert grew("vllm:request_success_total", 'finished_reason="length",' + model) == 1
    # Gauges read the engine's stats at scrape time: idle lanes still hold their conversations.
    stats = engine.stats()
    assert stats["pool_cells_holding_tokens"] > 0 and stats["lanes_busy"] == 0
    assert metric(text, "vllm:num_requests_running", model) == 0
    assert metric(text, "vllm:num_requests_waiting", model) == stats["queue_length"]
    usage = stats["pool_cells_holding_tokens"] / 4096
    assert metric(text, "vllm:kv_cache_usage_perc", model) == pytest.approx(usage)
    assert metric(text, "vllm:gpu_cache_usage_perc", model) == pytest.approx(usage)
    assert metric(text, "strata_engine_pool_usage_fraction") == pytest.approx(usage)
    assert metric(text, "strata_engine_pool_cells_holding_tokens") == stats["pool_cells_holding_tokens"]
    assert "# HELP strata_engine_pool_cells_used the older name of pool_cells_reserved" in text


def test_vllm_gauges_follow_a_busy_engine() -> None:
    from strata.serve.metrics import ServeMetrics

    figures = {"lanes_busy": 3, "queue_length": 2, "pool_cells_total": 1000, "pool_cells_holding_tokens": 250}
    text = ServeMetrics(lambda: figures, lambda: "m1").render().decode()
    assert metric(text, "vllm:num_requests_running", 'model_name="m1"') == 3
    assert metric(text, "vllm:num_requests_waiting", 'model_name="m1"') == 2
    assert metric(text, "vllm:kv_cache_usage_perc", 'model_name="m1"') == 0.25  # from the cells alone
    loading = ServeMetrics(lambda: None).render().decode()
    assert "vllm:num_requests_running{" not in loading  # no figures before the model is loaded


def test_each_app_has_its_own_registry() -> None:
    a, b = build_app(FakeEngine()), build_app(FakeEngine())
    assert a.state.strata.metrics.registry is not b.state.strata.metrics.registry


def test_state_json(http: httpx.Client) -> None:
    body = http.get("/v1/state").json()
    assert body["ready"] is True and body["model"] == "fake-model" and body["max_context"] == 256
    assert body["stats"]["kv_format"] == "bf16"
    assert body["stats"]["chunks_per_session"] == {"0": 0, "1": 0}


def test_one_log_line_per_request(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="strata.serve"):
        http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0,
                                                "user": "alice"})
        wait_for(lambda: any("/v1/chat/completions" in r.getMessage() for r in caplog.records))
    lines = [r.getMessage() for r in caplog.records if "/v1/chat/completions" in r.getMessage()]
    assert len(lines) == 1
    assert re.match(r"POST /v1/chat/completions 200 \d+\.\d{3}s prompt=\d+ completion=14 cached=\d+ "
                    r"finish=stop user='alice'$", lines[0]), lines[0]


def test_disconnect_mid_stream_cancels_and_frees_the_lane(server: ServerThread, engine: FakeEngine,
                                                          http: httpx.Client) -> None:
    engine.delay = 0.02
    text = http.get("/metrics").text
    before = metric(text, "strata_client_disconnects_total")
    aborts = metric_or_zero(text, "vllm:request_success_total", 'finished_reason="abort",model_name="fake-model"')
    with httpx.Client(base_url=server.url, timeout=10) as client:
        body = {"model": "m", "messages": LONG, "stream": True, "temperature": 0}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
    wait_for(lambda: len(engine.cancels) == 1)
    handle = engine.cancels[0]
    assert handle.events_sent < 300  # stopped long before its natural end
    text = http.get("/metrics").text
    assert metric(text, "strata_engine_lanes_busy") == 0
    assert metric(text, "strata_client_disconnects_total") == before + 1
    wait_for(lambda: metric_or_zero(http.get("/metrics").text, "vllm:request_success_total",
                                    'finished_reason="abort",model_name="fake-model"') == aborts + 1)


def test_disconnect_while_waiting_for_a_whole_answer(server: ServerThread, engine: FakeEngine,
                                                     http: httpx.Client) -> None:
    engine.delay = 0.02
    body = {"model": "m", "messages": LONG, "max_tokens": 50, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/messages", json=body, timeout=0.3)
    wait_for(lambda: len(engine.cancels) == 1)
    assert engine.cancels[0].events_sent < 50
    wait_for(lambda: metric(http.get("/metrics").text, "strata_engine_lanes_busy") == 0)


def test_grammar_figures_are_counters() -> None:
    from strata.serve.metrics import ServeMetrics

    text = ServeMetrics(lambda: {"grammar_rows": 7, "grammar_wait_s": 0.5, "lanes_busy": 1}).render().decode()
    assert "# TYPE strata_engine_grammar_rows_total counter" in text
    assert "strata_engine_grammar_rows_total 7.0" in text
    assert "strata_engine_grammar_wait_s_total 0.5" in text
    assert "# TYPE strata_engine_lanes_busy gauge" in text
