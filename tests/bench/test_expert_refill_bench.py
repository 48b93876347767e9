"""benchmarks/expert_refill.py: the refill's host time per step and the hit rate it reaches, as JSON."""

from __future__ import annotations

import json

from benchmarks import expert_refill


def test_reports_a_row_per_lane_count(capsys) -> None:
    assert expert_refill.main(["--layers", "3", "--experts", "16", "--top-k", "2", "--slots", "4",
                               "--lanes", "1,4", "--steps", "20"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["lanes"] for r in rows] == [1, 4]
    assert all(r["after_step_ms"] > 0 and 0 < r["hit_rate"] < 1 for r in rows)


def test_no_slots_to_fill_no_hits(capsys) -> None:
    """The control: with no copies a step, nothing is ever resident."""
    expert_refill.main(["--layers", "2", "--experts", "16", "--top-k", "2", "--slots", "4",
                        "--lanes", "1", "--steps", "10", "--uploads", "0"])
    assert json.loads(capsys.readouterr().out)[0]["hit_rate"] == 0
