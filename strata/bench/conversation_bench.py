"""Conversation cache figures (JSON): later-turn TTFT warm vs cold, park/restore bandwidth,
incremental vs full re-park at a full cache.

    python -m strata.bench.conversation_bench [--system-tokens 2000] [--turns 3] [--chats 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from strata.bench.report import emit
from strata.engine.config import EngineConfig
from strata.engine.conversation_cache import ConversationCache
from strata.engine.engine import Engine
from strata.engine.parking import Parking, write_entry
from strata.engine.scheduler import Lane
from strata.engine.types import SamplingParams
from strata.kv.formats import make_format
from strata.kv.pool import KvPool

TEXT = Path("/usr/share/common-licenses/GPL-3")


def _system_prompt(tok: Any, n_tokens: int) -> str:
    words = TEXT.read_text().split() if TEXT.exists() else ["license"] * 20000
    text, step = "", 400
    while len(tok.encode(text)) < n_tokens:
        text = " ".join(words[: len(text.split()) + step])
    return text


def replay(engine: Engine, system: str, chats: int, turns: int) -> list[dict]:
    """Interleaved multi-turn chats on one shared system prompt: TTFT of every turn."""
    tok = engine.tokenizer
    msgs = [[{"role": "system", "content": system}] for _ in range(chats)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    rows = []
    for turn in range(turns):
        for c in range(chats):
            msgs[c].append({"role": "user", "content": f"Question {turn} of chat {c}: summarise it."})
            ids = tok.encode(tok.apply_chat_template(msgs[c], add_generation_prompt=True))
            t0 = time.perf_counter()
            it = iter(engine.generate(ids, params))
            first = next(it)
            ttft = time.perf_counter() - t0
            events = [first, *it]
            text = "".join(e.text for e in events)
            msgs[c].append({"role": "assistant", "content": text})
            rows.append({"turn": turn, "chat": c, "prompt_tokens": len(ids), "ttft_s": ttft,
                         "cached_tokens": events[-1].cached_tokens})
    return rows


def bandwidth(kv: str, tokens: int, layers: int = 30, kv_heads: int = 3, head_dim: int = 64) -> dict:
    """Park, restore and re-park times of a `tokens`-long conversation in the default model's shape."""
    fmt = make_format(kv, kv_heads, head_dim)
    pool = KvPool(fmt, layers, 2, tokens + 4096, 256, None)
    lane = Lane(0, tokens=list(range(tokens)))
    nbytes = tokens * pool.bytes_per_cell()
    cache = ConversationCache(int(nbytes * 2.2), 2)
    park = Parking(pool, cache)
    t0 = time.perf_counter()
    park.park(lane)
    full_s = time.perf_counter() - t0
    eid = cache.entry_ids()[0]
    t0 = time.perf_counter()
    entry = cache.take(eid)
    write_entry(pool, 1, entry, tokens)
    restore_s = time.perf_counter() - t0
    # fill the cache to its budget with another conversation, then re-park the growing one
    other = Lane(1, tokens=[7] * tokens)
    park.park(other)
    reparks = []
    for turn in range(1, 5):  # each turn: the conversation grew by 300 tokens, then leaves again
        lane.tokens = list(range(tokens + 300 * turn))
        t0 = time.perf_counter()
        park.park(lane)
        reparks.append(time.perf_counter() - t0)
        entry = cache.take(cache.lookup(lane.tokens)[0])  # its client came back: restored
    incremental_s = sum(reparks[1:]) / len(reparks[1:])  # the first pays the one geometric growth
    fresh = ConversationCache(int(nbytes * 2.2), 2)
    t0 = time.perf_counter()
    Parking(pool, fresh).park(lane)
    full_final_s = time.perf_counter() - t0
    s = cache.stats()
    return {"kv": kv, "tokens": tokens, "bytes": nbytes, "full_park_s": full_s,
            "park_GBps": nbytes / full_s / 1e9, "restore_s": restore_s,
            "restore_GBps": nbytes / restore_s / 1e9, "incremental_repark_s": incremental_s,
            "repark_seconds_by_turn": reparks, "full_park_same_length_s": full_final_s,
            "incremental_parks": s.incremental_parks, "full_parks": s.full_parks,
            "cache_bytes": s.bytes, "budget_bytes": s.budget_bytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.conversation_bench",
                                description=__doc__)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--chats", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--long-tokens", type=int, default=32000)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    out: dict[str, Any] = {}
    base = dict(parallel=1, max_context=8192, kv_chunk=256)
    for name, extra in (("cold", {"prefix_reuse": False}),
                        ("warm", {"conversation_cache_mib": 1024, "conversation_cache_slots": 16})):
        with Engine(EngineConfig(**base, **extra)) as eng:
            system = _system_prompt(eng.tokenizer, a.system_tokens)
            out[name] = replay(eng, system, a.chats, a.turns)
            out[name + "_stats"] = {k: v for k, v in eng.stats().items()
                                    if k.startswith("conversation") or k.startswith("prefix")}
    later = lambda rows: [r["ttft_s"] for r in rows if r["turn"] > 0]  # noqa: E731
    out["later_turn_ttft_cold_s"] = sum(later(out["cold"])) / len(later(out["cold"]))
    out["later_turn_ttft_warm_s"] = sum(later(out["warm"])) / len(later(out["warm"]))
    out["speedup"] = out["later_turn_ttft_cold_s"] / out["later_turn_ttft_warm_s"]
    out["bandwidth"] = bandwidth("bf16", a.long_tokens)
    emit(out, a.out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
