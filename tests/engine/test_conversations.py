"""Conversations kept between turns: parking, restoring, session files; all byte-exact."""

from __future__ import annotations

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sessions import SessionFilesDisabled
from strata.engine.types import SamplingParams
from strata.errors import BadRequest, SessionFileError
from tests.chat_replay import chat_prompt, replay

SYSTEM = ("You are a careful assistant for a small library. Answer briefly, cite the shelf "
          "number when you know it, and never invent a book. ") * 3
QUESTIONS = [
    ["Do you have books about rivers?", "Which one is shortest?", "Thanks, and about lakes?"],
    ["Where is the poetry section?", "Is it open on Sundays?", "Who runs it?"],
    ["Can I renew a loan online?", "How many times?", "And the fee?"],
    ["Recommend a mystery novel.", "Something older?", "Shorter please."],
]


@pytest.fixture(scope="module")
def tiny(tiny_loaded):
    return tiny_loaded


def _engine(loaded, **kw) -> Engine:
    base = dict(model=loaded.path, device="cpu", dtype="bfloat16", max_context=512, kv_chunk=32)
    base.update(kw)
    return Engine(EngineConfig(**base), loaded=loaded)


def _prompt(loaded, messages: list[dict]) -> list[int]:
    return chat_prompt(loaded.tokenizer, messages)


PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def _replay(loaded, eng: Engine, cancel_first: bool = False) -> list[tuple[list[int], list[int], int]]:
    """Four conversations, turn by turn, interleaved: (prompt, output ids, cached tokens)."""
    return replay(eng, SYSTEM, QUESTIONS, PARAMS, cancel_first)


def _cold(loaded, prompts: list[list[int]]) -> list[list[int]]:
    with _engine(loaded, parallel=1, prefix_reuse=False) as eng:
        return [eng.complete(p, PARAMS).token_ids for p in prompts]


@pytest.mark.parametrize("cancel_first", [False, True])
def test_replay_with_parking_is_byte_identical_to_reading_from_zero(tiny, cancel_first) -> None:
    with _engine(tiny, parallel=2, kv_pool_tokens=1024, conversation_cache_mib=64,
                 conversation_cache_slots=8) as eng:
        turns = _replay(tiny, eng, cancel_first)
        stats = eng.stats()
    cold = _cold(tiny, [p for p, _, _ in turns])
    assert [o for _, o, _ in turns] == cold
    cache = stats["conversation_cache"]
    assert stats["conversation_parks"] > 0, "more conversations than lanes must park"
    assert stats["conversation_restores"] > 0
    assert cache["incremental_parks"] > 0, "a restored conversation re-parks incrementally"
    later = [cached for _, _, cached in turns[len(QUESTIONS):]]
    assert all(c > len(SYSTEM) // 8 for c in later), "later turns reuse their conversation"


def test_two_clients_with_one_system_prompt_each_find_their_own(tiny) -> None:
    with _engine(tiny, parallel=1, conversation_cache_mib=64) as eng:
        a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Alpha?"}]
        b = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Beta?"}]
        ra = eng.complete(_prompt(tiny, a), PARAMS)
        eng.complete(_prompt(tiny, b), PARAMS)  # displaces a (parked)
        a += [{"role": "assistant", "content": tiny.tokenizer.decode(ra.token_ids)},
              {"role": "user", "content": "More?"}]
        ids = _prompt(tiny, a)
        r = eng.complete(ids, PARAMS)
    assert r.cached_tokens >= len(_prompt(tiny, a[:2])) - 1
    assert r.token_ids == _cold(tiny, [ids])[0]


def test_session_file_survives_an_engine_restart(tiny, tmp_path) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    with _engine(tiny, parallel=2, session_dir=str(tmp_path)) as eng:
        r1 = eng.complete(_prompt(tiny, msgs), PARAMS)
        lane = next(i for i, n in eng.stats()["tokens_per_session"].items() if n)
        saved = eng.save_session(lane, "chat.strata")
    msgs += [{"role": "assistant", "content": tiny.tokenizer.decode(r1.token_ids)},
             {"role": "user", "content": "And then?"}]
    ids = _prompt(tiny, msgs)
    with _engine(tiny, parallel=2, kv_pool_tokens=512, session_dir=str(tmp_path)) as eng:
        restored = eng.restore_session(1, "chat.strata")
        assert restored.n_tokens == saved.n_tokens
        r2 = eng.complete(ids, PARAMS)
    assert r2.cached_tokens >= saved.n_tokens - 1
    assert r2.token_ids == _cold(tiny, [ids])[0]


def test_bad_session_files_leave_the_engine_unchanged(tiny, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    with _engine(tiny, parallel=1, session_dir=str(tmp_path)) as eng:
        eng.complete(_prompt(tiny, msgs), PARAMS)
        eng.save_session(0, "good")
        raw = (tmp_path / "good").read_bytes()
        (tmp_path / "short").write_bytes(raw[: len(raw) // 2])
        bad = bytearray(raw)
        bad[-5] ^= 0xFF
        (tmp_path / "flipped").write_bytes(bytes(bad))
        before = (eng.stats()["tokens_per_session"], eng.pool.used_cells)
        for name, err, words in [("short", SessionFileError, "truncated"),
                                 ("flipped", SessionFileError, "checksum"),
                                 ("missing", SessionFileError, "missing"),
                                 ("../good", BadRequest, "session"),
                                 ("/etc/passwd", BadRequest, "session")]:
            with pytest.raises(err) as info:
                eng.restore_session(0, name)
            assert name.split("/")[-1] in str(info.value) or words in str(info.value)
        assert (eng.stats()["tokens_per_session"], eng.pool.used_cells) == before
        assert eng.complete(_prompt(tiny, msgs), PARAMS).completion_tokens == PARAMS.max_tokens
    with _engine(tiny, parallel=1, session_dir=str(tmp_path), kv="fp16") as eng:
        with pytest.raises(SessionFileError, match="kv"):
            eng.restore_session(0, "good")
    with _engine(tiny, parallel=1) as eng:
        with pytest.raises(SessionFilesDisabled, match="--session-dir"):
            eng.save_session(0, "x")


def test_a_parked_conversation_can_be_saved_and_restored(tiny, tmp_path) -> None:
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Alpha?"}]
    with _engine(tiny, parallel=1, conversation_cache_mib=64, session_dir=str(tmp_path)) as eng:
        ra = eng.complete(_prompt(tiny, a), PARAMS)
        eng.complete(_prompt(tiny, [{"role": "user", "content": "Something else."}]), PARAMS)
        parked = eng.parked()
        assert len(parked) == 1 and parked[0]["n_tokens"] > 0  # a's conversation left its lane
        saved = eng.save_parked_session(parked[0]["id"], "alpha")
        assert saved.n_tokens == parked[0]["n_tokens"]
        with pytest.raises(BadRequest, match="no parked conversation"):
            eng.save_parked_session(12345, "nothing")
    a += [{"role": "assistant", "content": tiny.tokenizer.decode(ra.token_ids)},
          {"role": "user", "content": "More?"}]
    ids = _prompt(tiny, a)
    with _engine(tiny, parallel=1, session_dir=str(tmp_path)) as eng:
        eng.restore_session(0, "alpha")
        r = eng.complete(ids, PARAMS)
    # the reply text re-encodes to other ids than the sampled ones: the prompt part is shared
    assert r.cached_tokens >= len(_prompt(tiny, a[:2])) - 1
    assert r.token_ids == _cold(tiny, [ids])[0]
