"""Session files through real `strata serve` processes on the tiny GGUF.

A conversation saved from one server process is restored by the next one (same
--session-dir) and its next turn reads only what the file does not hold, with
the same greedy answer as a fresh server reading it from token 0. Bad files
and names are refused with a 4xx in the API's error shape, the lanes unchanged
and the server still serving; without --session-dir the endpoints answer 501.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import GREEDY, ServeProcess
from tiny_gguf import write_tiny_gguf

TURN1 = [{"role": "user", "content": "hello there"}]


def _tiny_args(model: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--parallel", "2", "--max-context", "512", *extra]


def _chat(srv: ServeProcess, messages: list[dict[str, str]], max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, **GREEDY}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _slot(srv: ServeProcess, lane: int, action: str, filename: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/slots/{lane}?action={action}", json={"filename": filename}, timeout=60)


def _slots(srv: ServeProcess) -> list[dict[str, Any]]:
    return httpx.get(f"{srv.url}/slots", timeout=10).json()


def _foreign_session_files(session_dir: Path, tiny: Path, other: Path) -> None:
    """Files the serving engine must refuse: saved by another model, and with another --kv."""
    from strata.engine import Engine, EngineConfig, SamplingParams

    for model, kv, name in ((other, "auto", "other-model.bin"), (tiny, "fp16", "other-kv.bin")):
        cfg = EngineConfig(model=str(model), kv=kv, max_context=128, session_dir=str(session_dir))
        with Engine(cfg) as engine:
            engine.complete([1, 2, 3, 4, 5], SamplingParams(max_tokens=2, temperature=0))
            engine.save_session(0, name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, default_gguf: Path) -> Iterator[dict[str, Any]]:
    """Turn 1 on server A, saved to a file; A stopped and restarted as A2 (same folder).

    B (no --session-dir) starts with A, so the two loads overlap.
    """
    tmp = tmp_path_factory.mktemp("sessions")
    session_dir = tmp / "sessions"
    session_dir.mkdir()
    tiny = write_tiny_gguf(default_gguf, tmp / "tiny.gguf")
    a = ServeProcess("a", _tiny_args(tiny, "--session-dir", str(session_dir)), tmp)
    b = ServeProcess("b", _tiny_args(tiny), tmp)
    a.wait_ready()
    turn1 = _chat(a, TURN1)
    held = [s for s in _slots(a) if s["n_tokens"] > 0]
    assert len(held) == 1 and held[0]["state"] == "idle", _slots(a)
    r = _slot(a, held[0]["id"], "save", "conv.bin")
    assert r.status_code == 200, r.text
    a.stop()
    a2 = ServeProcess("a2", _tiny_args(tiny, "--session-dir", str(session_dir),
                                       "--conversation-cache-mib", "16"), tmp)
    _foreign_session_files(session_dir, tiny, write_tiny_gguf(default_gguf, tmp / "other.gguf", hidden=32))
    yield {"a2": a2.wait_ready(), "b": b, "dir": session_dir, "turn1": turn1, "held": held[0],
           "save": r.json()}
    for proc in (a2, b):
        proc.terminate()
    for proc in (a2, b):
        log = proc.stop()
        assert proc.proc.returncode == 0, log[-3000:]


def test_restore_after_restart_continues_like_a_fresh_read(saved: dict[str, Any]) -> None:
    a2, b, held, save = saved["a2"], saved["b"], saved["held"], saved["save"]
    path = saved["dir"] / "conv.bin"
    assert save["id_slot"] == held["id"] and save["filename"] == "conv.bin"
    assert save["n_saved"] == held["n_tokens"] and save["n_written"] == path.stat().st_size
    assert all(s["state"] == "empty" for s in _slots(a2))  # a new process holds nothing
    lane = 1 - held["id"]  # another lane than the one it was saved from
    r = _slot(a2, lane, "restore", "conv.bin")
    assert r.status_code == 200, r.text
    restored = r.json()
    assert restored["id_slot"] == lane and restored["filename"] == "conv.bin"
    assert restored["n_restored"] == held["n_tokens"] and restored["n_read"] == path.stat().st_size
    row = _slots(a2)[lane]
    assert row["state"] == "idle" and row["n_tokens"] == held["n_tokens"] and row["chunks"] >= 1
    turn2 = [*TURN1, {"role": "assistant", "content": saved["turn1"]["choices"][0]["message"]["content"]},
             {"role": "user", "content": "and then?"}]
    warm = _chat(a2, turn2, max_tokens=10)
    b.wait_ready()
    cold = _chat(b, turn2, max_tokens=10)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= saved["turn1"]["usage"]["prompt_tokens"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"]
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    for topic in ("boats", "trains"):  # a third conversation on two lanes parks one
        _chat(a2, [{"role": "user", "content": f"tell me about {topic}"}], max_tokens=2)
    metrics = a2.metrics()
    assert metrics["strata_engine_conversation_cache_enabled"] == 1
    assert metrics["strata_engine_conversation_cache_entries"] >= 1
    assert metrics["strata_engine_conversation_cache_full_parks"] >= 1
    assert metrics["strata_engine_conversation_parks_total"] >= 1
    assert b.metrics()["strata_engine_conversation_cache_enabled"] == 0


def test_without_session_dir_the_endpoints_answer_501(saved: dict[str, Any]) -> None:
    b = saved["b"].wait_ready()
    for action in ("save", "restore"):
        r = _slot(b, 0, action, "conv.bin")
        assert r.status_code == 501, r.text
        assert "--session-dir" in r.json()["error"]["message"]


def _corrupt_copies(session_dir: Path) -> None:
    data = (session_dir / "conv.bin").read_bytes()
    (session_dir / "truncated.bin").write_bytes(data[: len(data) - 64])
    flipped = bytearray(data)
    flipped[-10] ^= 0x01  # inside the last layer's K/V: only the payload checksum can notice
    (session_dir / "flipped.bin").write_bytes(bytes(flipped))
    shutil.copy(session_dir / "conv.bin", session_dir / "copy.bin")


@pytest.mark.parametrize("name, says", [
    ("truncated.bin", "truncated"),
    ("flipped.bin", "checksum"),
    ("other-model.bin", "another model"),
    ("other-kv.bin", "--kv fp16"),
    ("missing.bin", "cannot open"),
    ("..", "invalid session filename"),
    ("../sessions/copy.bin", "invalid session filename"),
    ("ABSOLUTE", "invalid session filename"),
])
def test_bad_files_and_names_are_refused_and_change_nothing(saved: dict[str, Any], name: str,
                                                            says: str) -> None:
    a2, session_dir = saved["a2"], saved["dir"]
    if not (session_dir / "flipped.bin").exists():
        _corrupt_copies(session_dir)
    if name == "ABSOLUTE":
        name = str(session_dir / "copy.bin")  # inside the folder, but a path: still refused
    before = _slots(a2)
    lane = max(before, key=lambda s: s["n_tokens"])["id"]
    if before[lane]["n_tokens"] == 0:  # run alone: give the lane a conversation to keep
        assert _slot(a2, lane, "restore", "conv.bin").status_code == 200
        before = _slots(a2)
    actions = ("restore", "save") if "filename" in says else ("restore",)
    for action in actions:
        r = _slot(a2, lane, action, name)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert says in err["message"] and err["param"] == "filename"
        assert name.startswith("/") or str(session_dir) not in err["message"]  # no server paths
        assert err["type"] == "invalid_request_error"
        assert err["code"] == ("invalid_request" if "filename" in says else "invalid_session_file")
    assert _slots(a2) == before  # the lane still holds its conversation
    assert sorted(p.name for p in session_dir.iterdir()) == sorted(
        ["conv.bin", "copy.bin", "flipped.bin", "truncated.bin", "other-model.bin", "other-kv.bin"])
    _chat(a2, [{"role": "user", "content": "still there?"}], max_tokens=2)
