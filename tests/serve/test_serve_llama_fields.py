"""/completion's `samplers`, `n_predict: 0` and `id_slot`, over the fake engine (the real engine's
side: tests/engine/test_lanes_and_prompt_only.py and test_serve_defaults_real.py, which reads /slots)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine

from strata.engine.types import SamplingParams
from strata.serve.errors import ApiError
from strata.serve.samplers import STRATA_ORDER, apply_samplers, parse_samplers

SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1)


def test_names_letters_and_aliases_are_llama_cpps() -> None:
    assert parse_samplers("etkpm") == list(STRATA_ORDER)
    assert parse_samplers(["Top-K", "nucleus", "minp", "temp", "penalties"]) == [
        "top_k", "top_p", "min_p", "temperature", "penalties"]
    for bad in (["mirostat"], "kz", ["infill"], ["adaptive_p"]):
        with pytest.raises(ApiError) as e:
            parse_samplers(bad)
        assert e.value.param == "samplers" and e.value.status == 400


def test_strata_s_order_and_orders_that_compute_the_same_are_accepted() -> None:
    assert apply_samplers(SAMPLED, list(STRATA_ORDER)) == SAMPLED
    same = ["penalties", "dry", "top_k", "typ_p", "temperature", "top_p", "min_p", "xtc"]  # top_k, temp commute
    assert apply_samplers(SAMPLED, same) == SAMPLED
    at_one = SamplingParams(temperature=1.0, top_k=40, top_p=0.95)  # temperature 1 changes nothing
    assert apply_samplers(at_one, ["top_k", "top_p", "min_p", "temperature"]) == at_one
    greedy = SamplingParams(temperature=0.0, top_k=40, top_p=0.5)  # filters keep the best token
    assert apply_samplers(greedy, ["top_p", "min_p", "top_k", "temperature"]) == greedy
    assert apply_samplers(SAMPLED, None) == SAMPLED


@pytest.mark.parametrize("order, words", [
    (["penalties", "top_k", "top_p", "min_p", "temperature"], "top_p before temperature"),  # llama.cpp's default
    (["penalties", "temperature", "top_p", "top_k", "min_p"], "top_p before top_k"),
    (["top_k", "penalties", "temperature", "top_p", "min_p"], "top_k before penalties"),
    (["penalties", "temperature", "top_k", "min_p", "top_p"], "min_p before top_p"),
    (["penalties", "temperature", "top_k", "top_p", "top_p", "min_p"], "top_p is named twice"),
])
def test_orders_that_would_change_the_result_are_refused(order: list[str], words: str) -> None:
    with pytest.raises(ApiError) as e:
        apply_samplers(SAMPLED, order)
    assert e.value.param == "samplers" and words in e.value.message, e.value.message


def test_a_sampler_left_out_is_off_as_in_llama_server() -> None:
    p = apply_samplers(SAMPLED, ["top_k"])
    assert (p.top_k, p.top_p, p.min_p, p.temperature, p.repetition_penalty) == (40, 1.0, 0.0, 1.0, 1.0)
    greedy = apply_samplers(SamplingParams(temperature=0.0), ["top_k"])
    assert not greedy.greedy  # no temperature sampler: llama-server samples at temperature 1


def test_samplers_through_completion(http: httpx.Client, engine: FakeEngine) -> None:
    body: dict[str, Any] = {"prompt": "hi", "temperature": 0.8, "top_k": 40, "top_p": 0.95, "n_predict": 2}
    assert http.post("/completion", json={**body, "samplers": "etkpm"}).status_code == 200
    assert engine.calls[-1][1].top_p == 0.95
    assert http.post("/completion", json={**body, "samplers": ["top_k", "temperature"]}).status_code == 200
    assert engine.calls[-1][1].top_p == 1.0  # left out: off
    sent = http.get("/props").json()["default_generation_settings"]["params"]["samplers"]
    assert http.post("/completion", json={**body, "samplers": sent}).status_code == 200  # /props' own order
    r = http.post("/completion", json={**body, "samplers": ["top_k", "top_p", "temperature"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "samplers"
    assert "penalties, temperature, top_k, top_p, min_p" in r.json()["error"]["message"]


def test_n_predict_0_reads_the_prompt_only(http: httpx.Client, engine: FakeEngine) -> None:
    out = http.post("/completion", json={"prompt": "warm me up", "n_predict": 0}).json()
    assert engine.calls[-1][1].max_tokens == 0
    assert out["content"] == "" and out["tokens_predicted"] == 0 and out["stop_type"] == "limit"
    again = http.post("/completion", json={"prompt": "warm me up", "n_predict": 2, "temperature": 0}).json()
    assert again["timings"]["cache_n"] > 0 and again["tokens_predicted"] == 2


def test_id_slot_pins_the_lane_and_answers_name_it(http: httpx.Client, engine: FakeEngine) -> None:
    out = http.post("/completion", json={"prompt": "hi", "id_slot": 1, "n_predict": 2}).json()
    assert engine.calls[-1][1].lane == 1 and out["id_slot"] == 1
    free = http.post("/completion", json={"prompt": "hi", "n_predict": 2}).json()
    assert engine.calls[-1][1].lane is None and free["id_slot"] == 0  # unpinned: the lane it got
    r = http.post("/completion", json={"prompt": "hi", "id_slot": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot" and "0..1" in r.json()["error"]["message"]
