"""The sampling a model's files recommend: generation_config.json in a folder, general.sampling.* in a GGUF."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from strata.models import load_model
from strata.models.generation_defaults import (
    ModelSampling,
    from_generation_config,
    from_gguf_metadata,
    read_generation_config,
)
from tests.serve.tiny_gguf import write_tiny_gguf

QWEN3_STYLE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6,
               "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}


@pytest.fixture
def folder_with(tmp_path: Path, tiny_model_dir: Path):
    """A copy of the tiny HF folder whose generation_config.json says `config`."""
    def make(config: dict) -> Path:
        out = tmp_path / "model"
        shutil.copytree(tiny_model_dir, out)
        (out / "generation_config.json").write_text(json.dumps(config))
        return out
    return make


def test_a_folders_generation_config_reaches_the_loaded_model(folder_with) -> None:
    path = folder_with(QWEN3_STYLE)
    loaded = load_model(str(path), device="cpu", dtype="bfloat16", progress=False)
    assert loaded.sampling.values() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                        "repetition_penalty": 1.05}
    assert loaded.sampling.source.endswith("generation_config.json")
    assert loaded.config.eos_token_ids[-2:] == [2, 3]  # the file's other use is unchanged


def test_do_sample_false_is_greedy_and_keeps_only_the_penalty() -> None:
    greedy = from_generation_config({"do_sample": False, "temperature": 0.7, "top_p": 0.8,
                                     "repetition_penalty": 1.1})
    assert greedy.values() == {"temperature": 0.0, "repetition_penalty": 1.1}
    sampled = from_generation_config({"temperature": 0.7, "top_p": 0.8})  # no do_sample: as written
    assert sampled.values() == {"temperature": 0.7, "top_p": 0.8}


def test_a_file_without_sampling_fields_says_nothing(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert read_generation_config(tmp_path) == ModelSampling()
    assert read_generation_config(tmp_path / "absent") == ModelSampling()
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_config(tmp_path) == ModelSampling()


def test_unusable_values_are_skipped_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    got = from_generation_config({"temperature": -1, "top_p": 0, "top_k": 2.5, "min_p": "x",
                                  "repetition_penalty": 1.2})
    assert got.values() == {"repetition_penalty": 1.2}
    assert "temperature -1" in caplog.text and "top_p 0" in caplog.text


def test_gguf_sampling_keys_written_by_gguf_py(tmp_path: Path, default_gguf: Path) -> None:
    def sampling(w) -> None:  # the GGUFWriter calls llama.cpp's converter makes
        w.add_sampling_temp(0.6)
        w.add_sampling_top_k(20)
        w.add_sampling_top_p(0.95)
        w.add_sampling_min_p(0.05)
        w.add_sampling_penalty_repeat(1.1)
        w.add_sampling_mirostat(2)

    path = write_tiny_gguf(default_gguf, tmp_path / "tiny.gguf", extra=sampling)
    loaded = load_model(str(path), device="cpu", dtype="bfloat16", progress=False, weights="dense")
    assert loaded.sampling.values() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                        "repetition_penalty": 1.1}  # float32 in the file, read back clean
    assert loaded.sampling.ignored == ("mirostat",) and loaded.sampling.source == "GGUF metadata"
    plain = load_model(str(write_tiny_gguf(default_gguf, tmp_path / "plain.gguf")), device="cpu",
                       dtype="bfloat16", progress=False, weights="dense")
    assert plain.sampling == ModelSampling()  # the negative control: a file without the keys


def test_gguf_top_k_minus_one_is_off() -> None:
    assert from_gguf_metadata({"general.sampling.top_k": -1}).values() == {"top_k": 0}
