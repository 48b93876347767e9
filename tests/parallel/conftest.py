"""Fixtures for stage tests: a four-layer tiny model (room for a main, a relay and a worker), a
shared key, and workers as threads or as `strata stage` processes."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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


class WorkerProcess:
    """`strata stage` in a child process; `address` once it listens."""

    def __init__(self, model: Path, key_file: Path, *extra: str, port: int = 0) -> None:
        cmd = [sys.executable, "-m", "strata.cli", "stage", "--listen", f"127.0.0.1:{port}",
               "--model", str(model), "--device", "cpu", "--dtype", "bfloat16", "--weights", "dense",
               "--stage-key-file", str(key_file), "--stage-timeout", "20", "--threads", "1", *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        line = self.wait_for("listening on", 60)
        self.address = re.search(r"listening on (\S+)", line).group(1)  # type: ignore[union-attr]
        self.port = int(self.address.rsplit(":", 1)[1])

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()

    def wait_for(self, text: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        with self._seen:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not self._seen.wait(0.2):
                    raise AssertionError(f"no {text!r} from the worker: {''.join(self.lines)[-2000:]}")
                self._seen.wait(left)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def worker_process(four_layers: Path, key_file: Path) -> Iterator[type[WorkerProcess]]:
    """Start `strata stage` processes (all killed at the end of the test)."""
    started: list[WorkerProcess] = []

    def start(*extra: str, model: Path = four_layers, port: int = 0) -> WorkerProcess:
        w = WorkerProcess(model, key_file, *extra, port=port)
        started.append(w)
        return w

    yield start  # type: ignore[misc]
    for w in started:
        if w.proc.poll() is None:
            w.kill()
