"""State models served by the engine: resumption through checkpoints.

Both hybrids: tiny Qwen3-Next (gated DeltaNet layers, recurrent state) and
tiny Gemma 3 (sliding layers of window 8 whose k/v are per-lane state; every
prompt here is longer than the window). Every answer is compared with the
same prompt read from token 0 by an engine that reuses nothing. A repeat
resumes from the checkpoint one token before its prompt's end (the first
read stopped there too), so it is the same arithmetic and must be identical;
a later turn resumes from the lane's whole state, an edit from the
checkpoint before it.
"""

from __future__ import annotations

import pytest
import torch

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.errors import SessionFileError
from tests.models.tiny_models import PROMPT, save_byte_tokenizer, save_tiny

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SYSTEM = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]
TURN1 = SYSTEM + [60, 61, 62, 63, 64]
TURN1_EDITED = SYSTEM + [60, 61, 99, 63, 64]


@pytest.fixture(scope="module", params=["qwen3_next", "gemma3"])
def folder(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path)
    save_byte_tokenizer(path)
    return str(path)


def _engine(folder: str, **flags) -> Engine:
    flags = {"parallel": 1, "prefill_chunk": 8, **flags}
    return Engine(EngineConfig(model=folder, device="cpu", dtype="float32", weights="dense",
                               max_context=128, **flags))


@pytest.fixture(scope="module")
def fresh(folder: str):
    """Greedy tokens of a prompt read from token 0 (nothing reused)."""
    eng = _engine(folder, prefix_reuse=False, ctx_checkpoints=0)
    cache: dict[tuple[int, ...], list[int]] = {}

    def answer(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = eng.complete(prompt, GREEDY).token_ids
        return cache[key]

    yield answer
    eng.close()


def test_turns_repeats_and_edits_resume_and_answer_as_from_zero(folder: str, fresh) -> None:
    with _engine(folder) as eng:
        first = eng.complete(TURN1, GREEDY)
        assert first.token_ids == fresh(TURN1) and first.cached_tokens == 0
        again = eng.complete(TURN1, GREEDY)  # a regenerate: from the checkpoint before the last token
        assert again.token_ids == first.token_ids and again.cached_tokens == len(TURN1) - 1
        turn2 = TURN1 + first.token_ids + [70, 71, 72]
        second = eng.complete(turn2, GREEDY)  # the lane's whole state: only the new message is read
        assert second.token_ids == fresh(turn2)
        assert second.cached_tokens == len(TURN1) + len(first.token_ids) - 1
        edited = TURN1_EDITED + [70]  # diverges inside the first user message: the checkpoint
        # before it is every 4 tokens' (--prompt-cache-min-step is off here), so from 0
        out = eng.complete(edited, GREEDY)
        assert out.token_ids == fresh(edited) and out.cached_tokens == 0
        stats = eng.stats()["checkpoints"]
    assert stats["saves"] >= 3 and stats["restores"] == 1 and stats["bytes_per_checkpoint"] > 0


def test_an_edit_resumes_from_the_latest_checkpoint_before_it(folder: str, fresh) -> None:
    with _engine(folder, prompt_cache_min_step=4) as eng:
        eng.complete(TURN1, GREEDY)
        edited = TURN1_EDITED + [70]
        out = eng.complete(edited, GREEDY)  # diverges at 22: the checkpoint at 16 (20 is too near it)
        assert out.cached_tokens == 16 and out.token_ids == fresh(edited)


def test_cut_points_inside_one_step(folder: str, fresh) -> None:
    """A prompt read in one step: Qwen3-Next's DeltaNet layers keep their state at the cut points
    inside it (16 and 24, `mix_cut`), so the read takes one step, not three, and an edit and a
    regenerate resume from those checkpoints with the answers of a read from 0. Gemma 3's window
    ring cannot, and stops at each cut as before."""
    with _engine(folder, prompt_cache_min_step=4, prefill_chunk=64) as eng:
        first = eng.complete(TURN1, GREEDY)
        inside, steps = eng.stats()["checkpoints"]["inside"], eng.steps
        again = eng.complete(TURN1, GREEDY)
        edited = TURN1_EDITED + [70]
        out = eng.complete(edited, GREEDY)
    assert first.token_ids == fresh(TURN1) and again.token_ids == first.token_ids
    assert again.cached_tokens == len(TURN1) - 1
    assert out.cached_tokens == 16 and out.token_ids == fresh(edited)
    if "qwen3_next" in folder:
        assert inside == 2 and steps == GREEDY.max_tokens  # the prompt step, then 9 decode steps
    else:
        assert inside == 0 and steps == GREEDY.max_tokens + 2


def test_a_named_cut_point_serves_an_edit_after_it(folder: str, fresh) -> None:
    """The server names the chat's message ends (`SamplingParams.cut_points`): the first user
    message starts at len(SYSTEM), so an edit of it resumes there."""
    named = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, cut_points=[len(SYSTEM)])
    with _engine(folder) as eng:
        eng.complete(TURN1, named)
        edited = SYSTEM + [99, 98, 97, 70]
        out = eng.complete(edited, GREEDY)
        assert out.cached_tokens == len(SYSTEM) and out.token_ids == fresh(edited)
        assert eng.wants_cut_points
    with _engine(folder, ctx_checkpoints=0) as eng:
        assert not eng.wants_cut_points


def test_a_cancelled_answer_then_its_repeat(folder: str, fresh) -> None:
    with _engine(folder) as eng:
        h = eng.generate(TURN1, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        for ev in h:
            if ev.token_ids:
                h.cancel()
        out = eng.complete(TURN1, GREEDY)
        assert out.token_ids == fresh(TURN1) and out.cached_tokens == len(TURN1) - 1


def test_a_damaged_checkpoint_changes_the_answer(folder: str, fresh) -> None:
    """Negative control: the repeat really runs on the checkpoint's state."""
    with _engine(folder) as eng:
        eng.complete(TURN1, GREEDY)

        def damage() -> None:
            cp = eng.checkpoints.lanes[0][-1]  # type: ignore[union-attr]
            layer = min(cp.state)
            for t in cp.state[layer].values():
                t.mul_(-3.0).add_(1.0)

        eng.call(damage).result()
        out = eng.complete(TURN1, GREEDY)
        assert out.cached_tokens == len(TURN1) - 1 and out.token_ids != fresh(TURN1)


OTHER = [1, 80, 81, 82, 83, 84, 85, 86, 87]


def _damage(states) -> None:
    """Change one layer's saved state (the negative controls)."""
    layer = min(states[-1].state)
    for t in states[-1].state[layer].values():
        t.mul_(-3.0).add_(1.0)


def test_a_parked_conversation_comes_back_with_its_state(folder: str, fresh) -> None:
    with _engine(folder, prompt_cache=4) as eng:
        first = eng.complete(TURN1, GREEDY)
        eng.complete(OTHER, GREEDY)  # one lane: the first chat is parked with its states
        assert eng.stats()["conversation_parks"] == 1
        turn2 = TURN1 + first.token_ids + [70, 71, 72]
        second = eng.complete(turn2, GREEDY)  # its state at the end of the answer: no re-read
        assert second.cached_tokens == len(TURN1) + len(first.token_ids) - 1
        assert second.token_ids == fresh(turn2)
        eng.complete(OTHER, GREEDY)
        again = eng.complete(TURN1, GREEDY)  # a regenerate: the parked checkpoint before the last token
        assert again.cached_tokens == len(TURN1) - 1 and again.token_ids == first.token_ids
        assert eng.stats()["conversation_restores"] == 3  # the second OTHER too


def test_a_parked_state_damaged_changes_the_answer(folder: str, fresh) -> None:
    with _engine(folder, prompt_cache=4) as eng:
        first = eng.complete(TURN1, GREEDY)
        eng.complete(OTHER, GREEDY)

        def damage() -> None:
            cache = eng.conversations
            assert cache is not None
            _damage(cache.entry(cache.entry_ids()[0]).states)

        eng.call(damage).result()
        turn2 = TURN1 + first.token_ids + [70]
        out = eng.complete(turn2, GREEDY)
        assert out.cached_tokens > 0 and out.token_ids != fresh(turn2)


def test_a_session_file_restores_the_state_and_its_checkpoints(folder: str, fresh, tmp_path) -> None:
    with _engine(folder, session_dir=str(tmp_path)) as eng:
        first = eng.complete(TURN1, GREEDY)
        saved = eng.save_session(0, "chat.bin")
        assert saved.n_tokens == len(TURN1) + len(first.token_ids) - 1
    turn2 = TURN1 + first.token_ids + [70, 71]
    with _engine(folder, session_dir=str(tmp_path)) as eng:
        eng.restore_session(0, "chat.bin")
        out = eng.complete(turn2, GREEDY)
        assert out.cached_tokens == saved.n_tokens and out.token_ids == fresh(turn2)
    with _engine(folder, session_dir=str(tmp_path)) as eng:
        eng.restore_session(0, "chat.bin")
        again = eng.complete(TURN1, GREEDY)  # the file's checkpoint one token before the prompt's end
        assert again.cached_tokens == len(TURN1) - 1 and again.token_ids == first.token_ids


def test_a_session_file_with_a_damaged_state_changes_the_answer(folder: str, fresh, tmp_path) -> None:
    with _engine(folder, session_dir=str(tmp_path)) as eng:
        first = eng.complete(TURN1, GREEDY)
        eng.save_session(0, "chat.bin")
        loaded = eng.sessions.read("chat.bin")
        _damage(loaded.states)
        eng.call(lambda: eng.sessions.install(0, loaded)).result()
        turn2 = TURN1 + first.token_ids + [70]
        out = eng.complete(turn2, GREEDY)
        assert out.cached_tokens > 0 and out.token_ids != fresh(turn2)


def test_a_session_file_without_state_is_refused(folder: str, tmp_path) -> None:
    from strata.engine.snapshot import save_session

    with _engine(folder, session_dir=str(tmp_path)) as eng:
        eng.complete(TURN1, GREEDY)
        layers = eng.pool.export_range(0, 0, len(TURN1))
        save_session(tmp_path / "bare.bin", TURN1, layers, model_identity=eng.loaded.identity,
                     kv_format=eng.pool.fmt.name)
        with pytest.raises(SessionFileError, match="bare.bin.*no recurrent state"):
            eng.restore_session(0, "bare.bin")
        assert eng.complete(TURN1, GREEDY).token_ids  # and the engine keeps serving


def test_streamed_kv_answers_as_resident(folder: str, fresh) -> None:
    with _engine(folder, kv_resident=16, kv_chunk=16) as eng:
        first = eng.complete(TURN1, GREEDY)
        turn2 = TURN1 + first.token_ids + [70, 71, 72] + list(range(90, 130))
        assert first.token_ids == fresh(TURN1)
        assert eng.complete(turn2, GREEDY).token_ids == fresh(turn2)
        assert eng.complete(TURN1, GREEDY).token_ids == first.token_ids


def test_a_dropped_state_changes_the_next_turn(folder: str, fresh) -> None:
    """Negative control: a later turn really continues the lane's state (for gemma3, the window:
    the turn starts past position 8, so every sliding layer reads its window's 7 cells)."""
    with _engine(folder) as eng:
        first = eng.complete(TURN1, GREEDY)
        turn2 = TURN1 + first.token_ids + [70, 71, 72]

        def drop() -> None:
            assert eng.states is not None
            for named in eng.states.layers.values():
                for t in named.values():
                    t[eng.states.slot_of[0]].zero_()

        eng.call(drop).result()
        out = eng.complete(turn2, GREEDY)
        assert out.cached_tokens == len(TURN1) + len(first.token_ids) - 1
        assert out.token_ids != fresh(turn2)


# the tiny configs (tests/models/tiny_models.py) in float32: one layer's K/V cell is
# 2 (k, v) x num_kv_heads x head_dim x 4 bytes
TINY = {"gemma3": dict(layers=6, pool_layers=(5,), kv_heads=1, head_dim=32, window=8),
        "qwen3_next": dict(layers=4, pool_layers=(3,), kv_heads=2, head_dim=16, window=None)}


def test_the_pool_holds_only_the_layers_that_attend_over_it(folder: str) -> None:
    kind = "gemma3" if "gemma3" in folder else "qwen3_next"
    tiny = TINY[kind]
    cell = 2 * tiny["kv_heads"] * tiny["head_dim"] * 4
    with _engine(folder, parallel=3) as eng:
        pool, states = eng.pool, eng.states
        assert "layer state" in eng.summary() and "8 checkpoints a conversation" in eng.summary()
        assert pool.layer_ids == tiny["pool_layers"]
        assert pool.bytes_per_cell() == cell * len(tiny["pool_layers"]) == 256  # every layer: 6x, 4x
        assert pool.total_bytes() == (pool.num_chunks + 1) * pool.chunk_size * 256
        assert states is not None and len(states.layers) == tiny["layers"] - len(tiny["pool_layers"])
        if kind == "gemma3":  # 3 lanes x a ring of 8 cells x 5 sliding layers, in the model's dtype
            assert all(set(named) == {"k", "v"} for named in states.layers.values())
            assert all(t.shape == (3, tiny["window"], 1, 32) and t.dtype == torch.float32
                       for named in states.layers.values() for t in named.values())
            assert states.total_bytes() == 3 * 8 * 5 * cell == 30720
            assert states.bytes_per_lane() == 8 * 5 * cell == 10240


def test_prompt_graphs_asked_for_where_they_cannot_run_say_so(folder: str, caplog) -> None:
    """--prompt-graphs on the CPU (no CUDA graphs) is not silently dropped: one warning names
    what it takes, and the engine serves as without it."""
    import logging

    with caplog.at_level(logging.WARNING, logger="strata.engine"):
        with _engine(folder, prompt_graphs=True) as eng:
            assert eng.runner.prompt_graphs is None
            assert len(eng.complete(PROMPT, GREEDY).token_ids) == GREEDY.max_tokens
    assert caplog.text.count("--prompt-graphs has no effect here") == 1
