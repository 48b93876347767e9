"""What start-up and /v1/state say about memory: weights per device against the file, the pool, free."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.stats import describe_memory
from strata.serve.metrics import EngineCollector


@pytest.fixture(scope="module")
def stats_and_log():
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    log = logging.getLogger("strata.engine")
    old = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with Engine(EngineConfig(threads=1)) as e:
            yield e.stats(), records
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def test_weights_take_the_files_bytes_and_are_reported(stats_and_log) -> None:
    s, _ = stats_and_log
    assert s["weight_mode"] == "gguf"
    held, file = s["weight_bytes"]["cpu"], s["weight_file_bytes"]
    assert abs(held - file) < 0.01 * file and file > 90e6  # the 96.6 MB of the embedded file
    assert s["pool_bytes"] > 0
    assert 0 < s["device_free_bytes"]["cpu"] <= s["device_total_bytes"]["cpu"]


def test_start_up_says_it_in_one_line(stats_and_log) -> None:
    s, records = stats_and_log
    lines = [r for r in records if r.startswith("memory:")]
    assert len(lines) == 1
    assert "weights (gguf) 0.09 GiB on cpu" in lines[0] and "tensors in the file: 0.09 GiB" in lines[0]
    assert "KV pool" in lines[0] and "free now: cpu" in lines[0]
    assert describe_memory(s).split("free now")[0] == lines[0].split("free now")[0]


def test_metrics_label_the_device(stats_and_log) -> None:
    s, _ = stats_and_log
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: s))
    text = generate_latest(registry).decode()
    line = next(x for x in text.splitlines() if x.startswith('strata_engine_weight_bytes{device="cpu"} '))
    assert float(line.split()[-1]) == s["weight_bytes"]["cpu"]
    assert 'strata_engine_device_free_bytes{device="cpu"}' in text
