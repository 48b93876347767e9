"""A real `strata serve` on a tiny GGUF that recommends sampling settings: the start-up line, /props, a
flag over the model's value, and llama-server's n_predict 0 and id_slot on the real engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess
from tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_gguf: Path) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("serve-defaults")

    def recommend(w) -> None:  # as llama.cpp's converter writes a generation_config.json's values
        w.add_sampling_temp(0.6)
        w.add_sampling_top_p(0.9)
        w.add_sampling_top_k(20)

    tiny = str(write_tiny_gguf(default_gguf, tmp / "tuned.gguf", extra=recommend))
    proc = ServeProcess("tuned", ["--model", tiny, "--parallel", "3", "--max-context", "512", "--top-k", "7"], tmp)
    yield proc.wait_ready()
    log = proc.stop()
    assert proc.proc.returncode == 0, log[-3000:]


def test_the_models_recommendation_and_a_flag_over_it(server: ServeProcess) -> None:
    params = httpx.get(f"{server.url}/props", timeout=30).json()["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_p"], params["top_k"]) == (0.6, 0.9, 7)
    assert params["min_p"] == 0.0  # the file says nothing: Strata's base
    log = server.log.read_text()
    assert "sampling defaults: temperature 0.6 (model), top_p 0.9 (model), top_k 7 (--top-k)" in log


def test_n_predict_0_warms_the_cache_and_id_slot_picks_the_lane(server: ServeProcess) -> None:
    prompt = "Once upon a time there was a lane"
    with httpx.Client(base_url=server.url, timeout=120) as c:
        warm = c.post("/completion", json={"prompt": prompt, "n_predict": 0, "id_slot": 2}).json()
        assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["id_slot"] == 2
        slots = {s["id"]: s["n_tokens"] for s in c.get("/slots").json()}
        assert slots[2] == warm["tokens_evaluated"] and slots[0] == slots[1] == 0  # kept in lane 2 only
        again = c.post("/completion", json={"prompt": prompt, "n_predict": 2, "temperature": 0}).json()
        assert again["id_slot"] == 2 and again["timings"]["cache_n"] == warm["tokens_evaluated"] - 1
        cold = c.post("/completion", json={"prompt": "Something else", "n_predict": 1, "id_slot": 0}).json()
        assert cold["id_slot"] == 0 and cold["timings"]["cache_n"] == 0  # the negative control
        r = c.post("/completion", json={"prompt": prompt, "id_slot": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot"
