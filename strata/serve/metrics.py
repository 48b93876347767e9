"""Prometheus metrics of one server: its own counters plus the engine's live figures.

Each app gets its own CollectorRegistry so that several apps (tests, or two
servers in one process) never share or double-register series. The engine's
`stats()` is read at scrape time by a custom collector, so /metrics always
shows the pool as it is now; keys it does not know are rendered generically.

Beside Strata's own names, the families vLLM's dashboards read (`vllm:...`, labelled
`model_name`) are fed by the same observations and the same stats() read, so a
Grafana board built for vLLM works unchanged and never disagrees with strata_*.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("strata.serve")

PREFIX = "strata_engine_"
# Engine figures that only ever grow: exposed as counters (name_total).
MONOTONIC_KEYS = {
    "prefix_reuse_hits", "prefix_tokens_reused", "refusals", "truncations", "evictions", "moves", "steps",
    "pipelined_steps", "grammar_rows", "grammar_wait_s", "grammar_mask_s",
    "step_errors", "conversation_parks", "conversation_restores", "conversation_tokens_restored",
    "restore_misses", "cpu_thread_switches", "cpu_thread_probes",
}
# The label used when a figure is a dict: chunks per session are keyed by lane.
DICT_LABELS = {"chunks_per_session": "lane", "tokens_per_session": "lane", "refusals": "reason",
               "weight_bytes": "device", "device_free_bytes": "device", "device_total_bytes": "device"}
# Dicts of distinct figures (not one figure per label): one gauge each, named key_sub.
# None means the feature is off; `key_enabled` tells that apart from a cache at zero.
FLATTENED_KEYS = {"conversation_cache", "expert_cache", "checkpoints", "speculation"}

# Help text of figures whose generic "engine figure" help would hide what they count.
HELP = {
    "pool_cells_total": "KV cells of the pool (per layer; one cell is one token's K/V): chunks x chunk size",
    "pool_cells_holding_tokens": "KV cells holding a token's K/V: the tokens kept by all lanes, busy and idle",
    "pool_cells_reserved": "KV cells in chunks reserved by lanes (whole chunks, written or not)",
    "pool_cells_used": "the older name of pool_cells_reserved: cells in reserved chunks, not tokens held",
    "pool_cells_free": "KV cells in chunks no lane has reserved",
    "pool_usage_fraction": "KV cells holding tokens / KV cells of the pool (0..1)",
    "lanes_busy": "lanes running a request",
    "queue_length": "requests waiting for a lane",
}

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def _metric_name(key: str) -> str:
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", str(key))


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


class EngineCollector(Collector):
    """Turns engine.stats() into metric families at each scrape."""

    def __init__(
        self, get_stats: Callable[[], dict[str, Any] | None], model_name: Callable[[], str] | None = None
    ) -> None:
        self.get_stats = get_stats
        self.model_name = model_name  # given: the vLLM-named gauges come with the scrape too

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.get_stats()
        except Exception:  # a failing stats() must not break the scrape of everything else
            log.exception("engine.stats() failed")
            return
        ready = GaugeMetricFamily("strata_ready", "1 once the model is loaded and serving")
        ready.add_metric([], 0.0 if stats is None else 1.0)
        yield ready
        for key, value in sorted((stats or {}).items()):
            if key == "stages":
                yield from self._stages(value or [])
                continue
            if key in FLATTENED_KEYS:
                yield from self._flattened(str(key), value)
                continue
            family = self._family(str(key), value)
            if family is not None:
                yield family
        if stats is not None and self.model_name is not None:
            yield from vllm_gauges(stats, self.model_name())

    @staticmethod
    def _flattened(key: str, value: Any) -> Iterator[Metric]:
        enabled = GaugeMetricFamily(_metric_name(f"{key}_enabled"), f"1 when the engine's {key} is on")
        enabled.add_metric([], 0.0 if value is None else 1.0)
        yield enabled
        for sub, sub_value in sorted((value or {}).items(), key=lambda kv: str(kv[0])):
            number = _number(sub_value)
            if number is not None:
                name = _metric_name(f"{key}_{sub}")
                family = GaugeMetricFamily(name, f"engine figure {key}[{sub!r}] from Engine.stats()")
                family.add_metric([], number)
                yield family

    @staticmethod
    def _stages(stages: list[dict[str, Any]]) -> Iterator[Metric]:
        """One gauge per numeric figure of the stages of a layer split, labelled by stage number,
        kind (local, remote) and device or address; the layer range as first/last layer."""
        fields = sorted({k for st in stages for k, v in st.items() if _number(v) is not None}
                        | {"first_layer", "last_layer"})
        for field in fields:
            family = GaugeMetricFamily(_metric_name(f"stage_{field}"), f"stage figure {field!r}",
                                       labels=["stage", "kind", "where"])
            for i, st in enumerate(stages):
                value = {"first_layer": st["layers"][0], "last_layer": st["layers"][1] - 1}.get(field, st.get(field))
                number = _number(value)
                if number is not None:
                    where = str(st.get("device") or st.get("address") or "")
                    family.add_metric([str(i), str(st.get("kind", "")), where], number)
            yield family

    def _family(self, key: str, value: Any) -> Metric | None:
        name = _metric_name(key)
        doc = HELP.get(key, f"engine figure {key!r} from Engine.stats()")
        counter = key in MONOTONIC_KEYS
        number = _number(value)
        if number is not None:
            family: Any = CounterMetricFamily(name, doc) if counter else GaugeMetricFamily(name, doc)
            family.add_metric([], number)
            return family
        if isinstance(value, dict):
            label = DICT_LABELS.get(key, "key")
            family = (
                CounterMetricFamily(name, doc, labels=[label])
                if counter
                else GaugeMetricFamily(name, doc, labels=[label])
            )
            for sub, sub_value in sorted(value.items(), key=lambda kv: str(kv[0])):
                sub_number = _number(sub_value)
                if sub_number is not None:
                    family.add_metric([str(sub)], sub_number)
            return family
        return None  # strings, lists: shown in /v1/state only


def vllm_gauges(stats: dict[str, Any], model_name: str) -> Iterator[Metric]:
    """vLLM's scheduler and cache gauges from the same stats() read as Strata's own, so dashboards
    built for vLLM show the numbers strata_engine_* shows in the same scrape."""
    usage = _number(stats.get("pool_usage_fraction"))
    if usage is None and stats.get("pool_cells_total"):  # an engine that only counts cells
        usage = float(stats.get("pool_cells_holding_tokens", 0)) / float(stats["pool_cells_total"])
    figures = [
        ("vllm:num_requests_running", "Number of requests running (lanes busy).", stats.get("lanes_busy")),
        ("vllm:num_requests_waiting", "Number of requests waiting for a lane.", stats.get("queue_length")),
        ("vllm:kv_cache_usage_perc", "KV-cache usage: cells holding tokens / pool cells. 1 means 100 percent.",
         usage),
        ("vllm:gpu_cache_usage_perc", "The older name of vllm:kv_cache_usage_perc (same value).", usage),
    ]
    for name, doc, value in figures:
        number = _number(value)
        if number is not None:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model_name], number)
            yield family
    spec = stats.get("speculation")
    if isinstance(spec, dict):  # vLLM's speculative-decoding counters (its names end in _total)
        for name, doc, key in (
                ("vllm:spec_decode_num_drafts", "Lane-steps that carried drafted tokens.", "verifications"),
                ("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.", "drafted_tokens"),
                ("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", "accepted_tokens")):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([model_name], float(spec.get(key, 0)))
            yield counter


class _Paired:
    """A Strata series whose every observation also goes to its vLLM-named twins, labelled with the
    model's name at that moment: one call site, so the two namings can never disagree."""

    def __init__(self, own: Any, twins: list[Any], model_name: Callable[[], str]) -> None:
        self.own = own
        self.twins = twins
        self.model_name = model_name

    def observe(self, amount: float) -> None:
        self.own.observe(amount)
        for twin in self.twins:
            twin.labels(model_name=self.model_name()).observe(amount)

    def inc(self, amount: float = 1) -> None:
        self.own.inc(amount)
        for twin in self.twins:
            twin.labels(model_name=self.model_name()).inc(amount)


class VllmSeries:
    """vLLM's request counters and histograms (docs.vllm.ai, "Production Metrics"), by model_name."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, m = registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", m, registry=r
        )
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=TTFT_BUCKETS, registry=r)
        # vLLM renamed time_per_output_token to inter_token_latency; dashboards use either.
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (= vllm:inter_token_latency_seconds).",
                              m, buckets=ITL_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds (arrival to last token).",
                             m, buckets=E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens per request.",
                                               m, buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens per request.", m,
            buckets=TOKEN_BUCKETS, registry=r,
        )
        self.success = Counter("vllm:request_success", "Count of finished requests by finished_reason.",
                               m + ["finished_reason"], registry=r)


class ServeMetrics:
    """The server's own series and their vLLM-named twins, registered on a private registry."""

    def __init__(
        self, get_stats: Callable[[], dict[str, Any] | None], model_name: Callable[[], str] = lambda: "strata"
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        vllm = self.vllm = VllmSeries(r)
        self.requests = Counter(
            "strata_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.active_requests = 0
        self.in_flight = Gauge("strata_requests_in_flight", "requests being answered now", registry=r)
        self.in_flight.set_function(lambda: self.active_requests)
        self.disconnects = Counter(
            "strata_client_disconnects", "requests whose client left before the end", registry=r
        )
        own = Counter("strata_prompt_tokens", "prompt tokens of answered requests", registry=r)
        self.prompt_tokens = _Paired(own, [vllm.prompt_tokens], model_name)
        self.cached_tokens = Counter(
            "strata_cached_prompt_tokens", "prompt tokens reused from a cached conversation", registry=r
        )
        own = Counter("strata_generated_tokens", "tokens generated", registry=r)
        self.generated_tokens = _Paired(own, [vllm.generation_tokens], model_name)
        own = Histogram(
            "strata_time_to_first_token_seconds",
            "from request arrival to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.ttft = _Paired(own, [vllm.ttft], model_name)
        own = Histogram(
            "strata_inter_token_latency_seconds",
            "time between generated tokens of one request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.itl = _Paired(own, [vllm.itl, vllm.tpot], model_name)
        self.duration = Histogram(
            "strata_request_duration_seconds", "whole request time by endpoint", ["endpoint"], registry=r
        )
        r.register(EngineCollector(get_stats, model_name))

    def finished(self, info: dict[str, Any], seconds: float) -> None:
        """One generation's end, from its access-log record: vLLM's per-request series.

        A request counts once it reached the engine and ended with a finish reason, or its
        client left ("abort"); a refusal or a failure is not a finished request in vLLM's sense.
        """
        finish = info.get("finish")
        reason = "abort" if finish == "disconnected" else finish
        if reason not in ("stop", "length", "abort"):
            return
        name = self.model_name()
        self.vllm.success.labels(model_name=name, finished_reason=reason).inc()
        self.vllm.e2e.labels(model_name=name).observe(seconds)
        self.vllm.request_prompt_tokens.labels(model_name=name).observe(info.get("prompt") or 0)
        self.vllm.request_generation_tokens.labels(model_name=name).observe(info.get("completion") or 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
