"""Fixtures for stage tests: a four-layer tiny model (room for a main, a relay and a worker), a
shared key, and workers as threads or as `strata stage` processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.stage_process import StageProcess
from strata.parallel.worker import StageWorker, WorkerOptions

KEY = "a-shared-stage-key-for-tests-0123"


@pytest.fixture(scope="session")
def four_layers(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model's tokenizer with four random layers."""
    import shutil

    from tests.tiny_llama import write_tiny_llama

    out = tmp_path_factory.mktemp("tiny-4")
    for f in tiny_model_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", "config.json")):
            shutil.copy(f, out / f.name)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    return write_tiny_llama(out, len(tok), tok.bos_token_id, tok.eos_token_id, layers=4)


@pytest.fixture(scope="session")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("key") / "stage.key"
    f.write_text(KEY + "\n")
    return f


@pytest.fixture
def thread_worker(four_layers: Path) -> Iterator:
    """Start workers serving on threads of this process (ports chosen by the system)."""
    started: list[StageWorker] = []

    def start(model: Path = four_layers, key: str = KEY, kv_resident: int | None = None,
              weights: str = "dense", **kw) -> StageWorker:
        w = StageWorker(WorkerOptions(model=str(model), device="cpu", dtype="bfloat16", weights=weights,
                                      kv_resident=kv_resident, listen="127.0.0.1:0", key=key.encode(),
                                      **kw))
        t = threading.Thread(target=w.serve_forever, daemon=True)
        t.start()
        started.append((w, t))
        return w

    yield start
    for w, t in started:
        w.stop()
        t.join(10)
        assert not t.is_alive(), "a stage worker did not stop"


@pytest.fixture
def worker_process(four_layers: Path, key_file: Path, tmp_path: Path) -> Iterator:
    """Start `strata stage` processes (all killed at the end of the test)."""
    started: list[StageProcess] = []

    def start(*extra: str, model: Path = four_layers, port: int = 0) -> StageProcess:
        flags = ["--model", str(model), "--device", "cpu", "--dtype", "bfloat16", "--weights", "dense",
                 "--stage-key-file", str(key_file), "--stage-timeout", "20", "--threads", "1", *extra]
        w = StageProcess(flags, tmp_path / f"stage{len(started)}.log", port=port, timeout=60)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()
