"""benchmarks/cpu_attention.py: one JSON line with a figure per thread count and context."""

from __future__ import annotations

import json

from benchmarks import cpu_attention


def test_reports_each_thread_count_and_context(capsys) -> None:
    assert cpu_attention.main(["--contexts", "64,600", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["threads"], r["context"]) for r in out["rows"]] == [(1, 64), (1, 600)]
    assert all(r["us_per_layer"] > 0 and r["kv_gb_per_s"] > 0 for r in out["rows"])
