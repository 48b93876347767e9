"""Session files checked against the running engine before any lane changes; only regular files read."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.snapshot import load_session, save_session
from strata.engine.types import SamplingParams
from strata.errors import SessionFileError


@pytest.fixture(scope="module")
def setup(tiny_loaded, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("sessions")
    cfg = EngineConfig(model=tiny_loaded.path, device="cpu", dtype="bfloat16", parallel=2,
                       max_context=256, kv_pool_tokens=512, kv_chunk=16, session_dir=str(folder))
    with Engine(cfg, loaded=tiny_loaded) as eng:
        prompt = tiny_loaded.tokenizer.encode("The quick brown fox jumps over")
        eng.complete(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        eng.save_session(0, "good.bin")
        yield eng, folder


def _forge(eng: Engine, folder: Path, name: str, change) -> None:
    """A file with a valid checksum whose content `change` altered."""
    tokens, layers = load_session(folder / "good.bin", model_identity=eng.loaded.identity,
                                  kv_format=eng.pool.fmt.name)
    tokens, layers = change(tokens, layers)
    save_session(folder / name, tokens, layers, model_identity=eng.loaded.identity,
                 kv_format=eng.pool.fmt.name)


def test_a_file_with_recurrent_state_is_refused_by_a_model_without(setup) -> None:
    eng, folder = setup
    tokens, layers = load_session(folder / "good.bin", model_identity=eng.loaded.identity,
                                  kv_format=eng.pool.fmt.name)
    save_session(folder / "stateful.bin", tokens, layers, model_identity=eng.loaded.identity,
                 kv_format=eng.pool.fmt.name, states=[(len(tokens), {"0.ssm": torch.zeros(2, 2)})])
    before = list(eng.scheduler.lanes[0].tokens)
    with pytest.raises(SessionFileError, match="stateful.bin.*no recurrent layers"):
        eng.restore_session(0, "stateful.bin")
    assert eng.scheduler.lanes[0].tokens == before


def _first_run(layers):
    return next(iter(layers[0]))


FORGERIES = {
    "fewer_layers": (lambda t, ls: (t, ls[:-1]), "layers"),
    "other_shape": (lambda t, ls: (t, [{k: torch.cat([v, v], dim=-1) for k, v in st.items()} for st in ls]),
                    "shape"),
    "other_dtype": (lambda t, ls: (t, [{k: v.float() if v.is_floating_point() else v.to(torch.int16)
                                        for k, v in st.items()} for st in ls]), "stores"),
    "other_runs": (lambda t, ls: (t, [{f"{k}_x": v for k, v in st.items()} for st in ls]), "runs"),
    "out_of_vocab": (lambda t, ls: (torch.cat([t[:-1], torch.tensor([10**6], dtype=t.dtype)]), ls),
                     "outside the vocabulary"),
}


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_forged_files_are_refused_and_the_lane_keeps_its_conversation(setup, kind: str) -> None:
    eng, folder = setup
    change, words = FORGERIES[kind]
    _forge(eng, folder, f"{kind}.bin", change)
    before = list(eng.scheduler.lanes[0].tokens)
    cells_before = eng.stats()["pool_cells_used"]
    assert before
    with pytest.raises(SessionFileError, match=words):
        eng.restore_session(0, f"{kind}.bin")
    assert eng.scheduler.lanes[0].tokens == before
    assert eng.stats()["pool_cells_used"] == cells_before
    eng.pool.check_invariants()
    eng.restore_session(1, "good.bin")  # a good file still restores
    assert eng.scheduler.lanes[1].tokens == before


def test_a_fifo_is_refused_at_once(setup) -> None:
    eng, folder = setup
    os.mkfifo(folder / "pipe.bin")
    outcome: list[BaseException | None] = []

    def restore() -> None:
        try:
            eng.restore_session(0, "pipe.bin")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    worker = threading.Thread(target=restore, daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():  # unblock the reader so the test process can end, then fail
        with open(folder / "pipe.bin", "wb"):
            pass
        pytest.fail("restoring from a FIFO blocked")
    assert isinstance(outcome[0], SessionFileError) and "not a regular file" in str(outcome[0])
    assert eng.complete([1, 2, 3], SamplingParams(max_tokens=2)).token_ids  # the engine still serves


def test_a_symlink_is_not_followed(setup) -> None:
    eng, folder = setup
    os.symlink(folder / "good.bin", folder / "link.bin")
    with pytest.raises(SessionFileError, match="symbolic link|regular"):
        eng.restore_session(0, "link.bin")


def test_another_models_file_names_both_full_identities(setup) -> None:
    eng, folder = setup
    tokens, layers = load_session(folder / "good.bin", model_identity=eng.loaded.identity,
                                  kv_format=eng.pool.fmt.name)
    other = eng.loaded.identity[:16] + "0" * (len(eng.loaded.identity) - 16)
    assert other != eng.loaded.identity
    save_session(folder / "other.bin", tokens, layers, model_identity=other, kv_format=eng.pool.fmt.name)
    with pytest.raises(SessionFileError) as info:
        eng.restore_session(0, "other.bin")
    assert other in str(info.value) and eng.loaded.identity in str(info.value)
