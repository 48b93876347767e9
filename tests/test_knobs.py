"""The one list of environment knobs: typed values, errors that name the knob, secrets hidden."""

from __future__ import annotations

import pytest

from strata.knobs import KNOBS, flag, knob, knob_values, text


def test_defaults_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in KNOBS:
        monkeypatch.delenv(k.name, raising=False)
    assert all(knob(k.name) == k.default for k in KNOBS)
    monkeypatch.setenv("STRATA_STREAM_OVERLAP", "0")
    monkeypatch.setenv("STRATA_GATHER_PROGRAMS", "7")
    assert flag("STRATA_STREAM_OVERLAP") is False and knob("STRATA_GATHER_PROGRAMS") == 7
    monkeypatch.setenv("STRATA_GPU_FUSED", "maybe")
    with pytest.raises(ValueError, match="STRATA_GPU_FUSED"):
        flag("STRATA_GPU_FUSED")


def test_a_text_knob_keeps_an_empty_value_and_a_secret_is_not_shown(monkeypatch) -> None:
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    assert text("STRATA_API_KEY") is None and knob_values()["STRATA_API_KEY"] is None
    monkeypatch.setenv("STRATA_API_KEY", "")
    assert text("STRATA_API_KEY") == ""  # refused at start-up, not taken for "unset"
    monkeypatch.setenv("STRATA_API_KEY", "s3cret")
    assert text("STRATA_API_KEY") == "s3cret" and knob_values()["STRATA_API_KEY"] == "set"
