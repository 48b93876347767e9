"""Prometheus metrics of one server: its own counters plus the engine's live figures.

Each app gets its own CollectorRegistry so that several apps (tests, or two
servers in one process) never share or double-register series. The engine's
`stats()` is read at scrape time by a custom collector, so /metrics always
shows the pool as it is now; keys it does not know are rendered generically.
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
FLATTENED_KEYS = {"conversation_cache", "expert_cache", "checkpoints"}

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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

    def __init__(self, get_stats: Callable[[], dict[str, Any] | None]) -> None:
        self.get_stats = get_stats

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
        doc = f"engine figure {key!r} from Engine.stats()"
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


class ServeMetrics:
    """The server's own series, registered on a private registry."""

    def __init__(self, get_stats: Callable[[], dict[str, Any] | None]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "strata_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.active_requests = 0
        self.in_flight = Gauge("strata_requests_in_flight", "requests being answered now", registry=r)
        self.in_flight.set_function(lambda: self.active_requests)
        self.disconnects = Counter(
            "strata_client_disconnects", "requests whose client left before the end", registry=r
        )
        self.prompt_tokens = Counter("strata_prompt_tokens", "prompt tokens of answered requests", registry=r)
        self.cached_tokens = Counter(
            "strata_cached_prompt_tokens", "prompt tokens reused from a cached conversation", registry=r
        )
        self.generated_tokens = Counter("strata_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "strata_time_to_first_token_seconds",
            "from request arrival to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "strata_inter_token_latency_seconds",
            "time between generated tokens of one request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "strata_request_duration_seconds", "whole request time by endpoint", ["endpoint"], registry=r
        )
        r.register(EngineCollector(get_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
