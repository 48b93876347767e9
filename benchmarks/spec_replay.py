"""Conversations replayed against a backend (Strata's engine or llama-server), timed per request.

A conversation's turns go one after another, each prompt rendered with the model's chat
template from the messages so far and the backend's own earlier answers; `lanes` conversations
run at once (a closed loop of `lanes` clients), so at one lane every request runs alone and at 16
lanes 16 conversations share the steps. Each request is timed from its sending to its first
token and to its last, so a run reports both its end-to-end rate (every generated token over the
run's wall time, prompt reads included) and a lane's decode rate (tokens after the first over
the time after the first token).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from benchmarks.llama_server import stream_completion
from benchmarks.spec_workloads import Conversation
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams


@dataclass
class Reply:
    """One request's answer and its times (perf_counter seconds)."""

    tokens: list[int]
    start: float
    first: float
    end: float
    timings: dict[str, Any] = field(default_factory=dict)  # llama-server's own, where it gives them


Send = Callable[[list[int], int], Reply]  # prompt ids, the request's sampling seed


@dataclass
class Record:
    conversation: str
    turn: int
    prompt_tokens: int
    reply: Reply


def _conversation(conv: Conversation, seed: int, send: Send, tokenizer: Any) -> list[Record]:
    """Every turn of `conv` in order, each answer added to the messages the next prompt renders."""
    messages = [dict(m) for m in conv.history]
    out = []
    for t, text in enumerate(conv.turns):
        messages.append({"role": "user", "content": text})
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
        reply = send(prompt, seed * 100 + t)
        out.append(Record(conv.name, t, len(prompt), reply))
        messages.append({"role": "assistant", "content": tokenizer.decode(reply.tokens)})
    return out


def replay(convs: Sequence[Conversation], lanes: int, send: Send, tokenizer: Any) -> tuple[list[Record], float]:
    """All conversations, `lanes` at a time; the records in conversation order and the wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        done = list(pool.map(lambda ic: _conversation(ic[1], ic[0], send, tokenizer), enumerate(convs)))
    return [r for records in done for r in records], time.perf_counter() - t0


def summarise(records: list[Record], wall: float) -> dict[str, Any]:
    """Rates of a replay: end to end (all tokens over the wall time) and a lane's decode rate."""
    tokens = sum(len(r.reply.tokens) for r in records)
    after_first = sum(max(0, len(r.reply.tokens) - 1) for r in records)
    decode_s = sum(r.reply.end - r.reply.first for r in records)
    first_s = [r.reply.first - r.reply.start for r in records]
    return {"requests": len(records), "prompt_tokens": sum(r.prompt_tokens for r in records),
            "generated_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": tokens / wall if wall else 0.0,
            "lane_decode_tokens_per_s": after_first / decode_s if decode_s else 0.0,
            "mean_time_to_first_token_s": sum(first_s) / len(first_s) if first_s else 0.0}


def outputs(records: list[Record]) -> dict[str, list[int]]:
    """Each request's answer by conversation and turn: what "identical" compares."""
    return {f"{r.conversation}/{r.turn}": r.reply.tokens for r in records}


def compare(ours: dict[str, list[int]], reference: dict[str, list[int]]) -> dict[str, Any]:
    """Whether every answer both runs gave is the same token for token, and where the first
    difference lies in those that differ (a later turn may differ because an earlier one did)."""
    shared = [k for k in ours if k in reference]
    differ = {}
    for k in shared:
        a, b = ours[k], reference[k]
        if a != b:
            differ[k] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"identical": bool(shared) and not differ, "compared": len(shared), "first_difference": differ}


def engine_sender(engine: Engine, max_tokens: int, temperature: float) -> Send:
    """Requests through `engine.generate`, timed as their events arrive."""
    def send(prompt: list[int], seed: int) -> Reply:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        start = time.perf_counter()
        first, tokens = None, []
        for ev in engine.generate(prompt, params):
            if ev.token_ids and first is None:
                first = time.perf_counter()
            tokens += ev.token_ids
        end = time.perf_counter()
        return Reply(tokens, start, first or end, end)

    return send


def llama_sender(url: str, max_tokens: int) -> Send:
    """Greedy requests to llama-server's /completion as token ids, streamed; its timings kept."""
    def send(prompt: list[int], seed: int) -> Reply:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "seed": seed,
                "cache_prompt": True, "return_tokens": True}
        start = time.perf_counter()
        first, tokens, timings = None, [], {}
        for ev in stream_completion(url, body):
            if ev.get("tokens") and first is None:
                first = time.perf_counter()
            tokens += ev.get("tokens", [])
            if ev.get("stop"):
                timings = ev.get("timings", {})
        end = time.perf_counter()
        return Reply(tokens, start, first or end, end, timings)

    return send


def llama_figures(records: list[Record]) -> dict[str, Any]:
    """llama-server's own figures summed over a replay: its decode rate and draft acceptance."""
    t = [r.reply.timings for r in records]
    n = sum(x.get("predicted_n", 0) for x in t)
    ms = sum(x.get("predicted_ms", 0.0) for x in t)
    drafted = sum(x.get("draft_n", 0) for x in t)
    accepted = sum(x.get("draft_n_accepted", 0) for x in t)
    return {"predicted_per_second": n / ms * 1e3 if ms else 0.0, "drafted_tokens": drafted,
            "accepted_tokens": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "cached_prompt_tokens": sum(x.get("cache_n", 0) for x in t)}
