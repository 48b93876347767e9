"""A small engine with the real Engine's interface and predictable text.

One character is one token, so counts are easy to check by eye. The reply
depends only on the prompt, the seed and the sampling switches, and knobs
(`refuse`, `fail_after`, `truncate_after`, `delay`) reproduce the engine's
refusals, failures and slow streams. Every generate() call and every cancel
is recorded for assertions. Session calls answer from the lane's token count
(or raise `session_error`) without touching files: the real engine's file
handling is tested against real `strata serve` processes.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

from strata.engine.config import EngineConfig
from strata.engine.sessions import SessionFilesDisabled, SessionResult
from strata.engine.types import (
    FinishReason,
    PromptProgress,
    SamplingParams,
    StreamEvent,
    TokenLogprob,
)
from strata.errors import BadRequest, LaneBusy
from strata.models.generation_defaults import ModelSampling

BOS, EOS = 1, 2
OFFSET = 10  # ids below are special
_handle_ids = itertools.count(1)
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]


class FakeTokenizer:
    chat_template = "fake"
    stop_token_ids: ClassVar[list[int]] = [EOS]
    vocab_size = 0x110000 + OFFSET

    def __init__(self) -> None:
        self.template_calls: list[dict[str, Any]] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) + OFFSET for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        specials = "" if skip_special_tokens else {BOS: "<s>", EOS: "</s>"}
        return "".join(chr(i - OFFSET) if i >= OFFSET else (specials.get(i, "") if specials else "")
                       for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        """Characters past U+00FF as their UTF-8 lead byte only: a half character, as byte tokens are."""
        text = self.decode([token_id], skip_special_tokens=False)
        raw = text.encode("utf-8", errors="surrogatepass")
        return raw[:1] if len(text) == 1 and ord(text) > 0xFF else raw

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: Any = None, **template_kwargs: Any,
    ) -> str:
        self.template_calls.append({"messages": messages, "kwargs": template_kwargs})
        if any(m.get("content") == "BREAK THE TEMPLATE" for m in messages):
            raise BadRequest("Conversation roles must alternate user/assistant", "messages")
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
            if template_kwargs.get("enable_thinking") is True:
                text += "<think>"
        return text


def reply_for(prompt: str, params: SamplingParams) -> str:
    """The whole text this fake model would write (before stop strings and limits)."""
    last_user = prompt.rsplit("<|user|>", 1)[-1].split("\n", 1)[0] if "<|user|>" in prompt else prompt
    if params.greedy:
        answer = f"You said: {last_user}."
    else:
        rng = random.Random(f"{params.seed}|{params.temperature}|{last_user}")
        answer = " ".join(rng.choice(WORDS) for _ in range(8)) + "."
    if "LONG" in last_user:
        answer = " ".join(WORDS * 6)
    if prompt.endswith("<think>"):
        return f"Thinking about {last_user}.</think>\n\n{answer}"
    if "MARKS THINKING" in last_user:
        return f"<think>I mark my own thoughts.</think>\n{answer}"
    return answer


@dataclass
class FakeHandle:
    engine: FakeEngine
    prompt_ids: list[int]
    params: SamplingParams
    cancelled: bool = False
    events_sent: int = field(default=0)
    id: int = field(default_factory=lambda: next(_handle_ids))
    lane: int | None = None  # the lane it runs on, once it runs (as RequestHandle.lane)

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.engine.cancels.append(self)

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        eng, p = self.engine, self.params
        if eng.refuse is not None:
            await asyncio.sleep(eng.refuse_delay)  # > the server's head wait: refused after the headers
            eng.refusals += 1
            raise eng.refuse
        prompt = eng.tokenizer.decode(self.prompt_ids)
        cached = max((_common(self.prompt_ids, old) for old in eng.seen), default=0)
        eng.seen.append(list(self.prompt_ids))
        if cached:
            eng.prefix_reuse_hits += 1
        full = reply_for(prompt, p) if eng.reply is None else eng.reply
        lane = self.lane = eng.take_lane(self)
        try:
            if p.progress:  # the prompt read in two halves
                total = len(self.prompt_ids)
                for done in (cached, (cached + total) // 2):
                    yield StreamEvent(text="", token_ids=[], prompt_tokens=total, cached_tokens=cached,
                                      progress=PromptProgress(total, cached, done))
            if eng.prompt_delay:
                await asyncio.sleep(eng.prompt_delay)
            async for ev in self._run(full, cached):
                yield ev
        finally:
            eng.release_lane(lane, self)

    async def _run(self, full: str, cached: int) -> AsyncIterator[StreamEvent]:
        eng, p = self.engine, self.params
        out = ""  # generated text, stop strings not yet ruled out included
        sent = 0  # characters of `out` already published
        n = 0
        if p.max_tokens == 0:  # the prompt only: it stays in the lane
            yield self._event("", [], 0, cached, FinishReason.LENGTH)
            return
        for ch in full:
            if eng.delay:
                await asyncio.sleep(eng.delay)
            else:
                await asyncio.sleep(0)
            if self.cancelled:
                yield self._event("", [], n, cached, FinishReason.CANCELLED)
                return
            if eng.fail_after is not None and n >= eng.fail_after:
                raise RuntimeError("fake engine exploded")
            n += 1
            out += ch
            tid = ord(ch) + OFFSET
            lps = [self._logprob(tid)] if p.logprobs is not None else []
            hit = _first_stop(out, p.stop)
            if hit is not None:
                cut, stop = hit
                yield self._event(out[sent:cut], [tid], n, cached, FinishReason.STOP, lps, stop=stop)
                return
            if eng.truncate_after is not None and n >= eng.truncate_after:
                eng.truncations += 1
                yield self._event(out[sent:], [tid], n, cached, FinishReason.LENGTH, lps, truncated=True)
                return
            if n >= p.max_tokens:
                yield self._event(out[sent:], [tid], n, cached, FinishReason.LENGTH, lps)
                return
            safe = len(out) - _held(out, p.stop)
            yield self._event(out[sent:safe], [tid], n, cached, None, lps)
            sent = safe
        yield self._event(out[sent:], [EOS], n + 1, cached, FinishReason.STOP)

    def _logprob(self, tid: int) -> TokenLogprob:
        text = self.engine.tokenizer.token_text(tid)
        alternatives = [(tid, text, -0.25), (OFFSET + ord("?"), "?", -1.5), (OFFSET + ord("!"), "!", -2.5)]
        return TokenLogprob(tid, text, -0.25, alternatives[: self.params.logprobs or 0])

    def _event(self, text: str, ids: list[int], n: int, cached: int, finish: FinishReason | None,
               lps: list[TokenLogprob] | None = None, stop: str | None = None,
               truncated: bool = False) -> StreamEvent:
        self.events_sent += 1
        return StreamEvent(text=text, token_ids=ids, finish_reason=finish, truncated=truncated,
                           prompt_tokens=len(self.prompt_ids), completion_tokens=n, cached_tokens=cached,
                           logprobs=lps or [], stop_string=stop)


def _common(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None


def _held(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that could still start a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                held = max(held, k)
                break
    return held


class FakeGrammars:
    """Records the grammars the server checks; `bad` makes the next check fail like the real one."""

    def __init__(self) -> None:
        self.checked: list[tuple[str, str]] = []
        self.bad: str | None = None

    def lltokenizer(self, param: str) -> SimpleNamespace:
        """No single-token markers: the fake's tokens are characters."""
        return SimpleNamespace(tokenize_str=lambda text, parse_special=False: [0] * len(text),
                               is_special_token=lambda token: False)

    def check(self, grammar: str, param: str) -> None:
        self.checked.append((grammar, param))
        if self.bad is not None:
            raise BadRequest(self.bad, param)


class FakeEngine:
    """Implements generate/stats/close/tokenizer/config/model_name like strata.engine.Engine."""

    TRAINED = 256  # the fake model's trained context: what -c 0 (the default) resolves to

    def __init__(self, max_context: int = TRAINED, lanes: int = 2) -> None:
        self._max_context = max_context or self.TRAINED  # as Engine resolves --max-context 0
        self.config = EngineConfig(max_context=self._max_context, parallel=lanes)
        self.model_name = "fake-model"
        self.tokenizer = FakeTokenizer()
        self.loaded = SimpleNamespace(sampling=ModelSampling())  # what the model's files recommend
        self.closed = False
        self.reset()

    def reset(self) -> None:
        """Back to defaults between tests (the server outlives one test)."""
        self.config.max_context = self._max_context
        self.refuse: Exception | None = None
        self.fail_after: int | None = None
        self.truncate_after: int | None = None
        self.delay = 0.0
        self.prompt_delay = 0.0  # seconds "reading the prompt" before the first token
        self.refuse_delay = 0.0
        self.reply: str | None = None
        self.grammars = FakeGrammars()
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.cancels: list[FakeHandle] = []
        self.seen: list[list[int]] = []
        self.config.session_dir = None
        self.lanes: dict[int, FakeHandle | None] = {i: None for i in range(self.config.parallel)}
        self.held: dict[int, int] = {}  # tokens each idle lane keeps after its request
        self.dead = False
        self.session_error: Exception | None = None
        self.session_calls: list[tuple[str, int, str]] = []
        self.conversation_cache: dict[str, int] | None = None
        self.wants_cut_points = False  # a recurrent model's engine: requests name their message ends
        self.prefix_reuse_hits = 0
        self.refusals = 0
        self.truncations = 0
        self.tokenizer.template_calls.clear()

    def summary(self) -> str:
        return f"{self.model_name} (fake) on cpu"

    def cancel_all(self) -> None:
        for handle in [h for h in self.lanes.values() if h is not None]:
            handle.cancel()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> FakeHandle:
        self.calls.append((list(prompt_ids), params))
        return FakeHandle(self, list(prompt_ids), params)

    def take_lane(self, handle: FakeHandle) -> int:
        """The request's pinned lane (`SamplingParams.lane`), else the first free one."""
        free = [i for i, h in self.lanes.items() if h is None]
        lane = handle.params.lane if handle.params.lane is not None else free[0] if free else max(self.lanes) + 1
        self.lanes[lane] = handle
        return lane

    def release_lane(self, lane: int, handle: FakeHandle) -> None:
        """Free `lane` if `handle` still has it: a stream finalized late (after a reset
        between tests) must not free the lane of the request that came after it."""
        if self.lanes.get(lane) is handle:
            self.held[lane] = len(handle.prompt_ids) + handle.events_sent
            self.lanes[lane] = None

    @property
    def alive(self) -> bool:
        return not (self.closed or self.dead)

    @property
    def scheduler(self) -> SimpleNamespace:
        """What the slot listing reads of the real scheduler: each lane's index and request
        (the request's id, prompt, sampling settings and generated tokens)."""
        def request(h: FakeHandle | None) -> SimpleNamespace | None:
            if h is None:
                return None
            return SimpleNamespace(id=h.id, prompt=h.prompt_ids, params=h.params, output=[0] * h.events_sent)
        return SimpleNamespace(lanes=[SimpleNamespace(index=i, request=request(h)) for i, h in self.lanes.items()])

    def _session(self, action: str, lane: int, filename: str) -> SessionResult:
        self.session_calls.append((action, lane, filename))
        if self.config.session_dir is None:
            raise SessionFilesDisabled()
        if self.session_error is not None:
            raise self.session_error
        n = self.held.get(lane, 0)
        return SessionResult(lane, filename, n, 100 + 8 * n)

    def save_session(self, lane: int, filename: str) -> SessionResult:
        return self._session("save", lane, filename)

    def restore_session(self, lane: int, filename: str) -> SessionResult:
        return self._session("restore", lane, filename)

    def erase_slot(self, lane: int) -> int:
        """As the real engine: an idle lane forgets what it holds; a busy one raises LaneBusy."""
        self.session_calls.append(("erase", lane, ""))
        if lane not in self.lanes:
            raise BadRequest(f"no lane {lane}: lanes are 0..{len(self.lanes) - 1}", "id_slot")
        if self.lanes[lane] is not None:
            raise LaneBusy(f"lane {lane} is busy: a request is using it; erase an idle lane", "id_slot")
        self.seen.clear()  # the fake's prefix reuse: nothing cached any more
        return self.held.pop(lane, 0)

    def parked(self) -> list[dict[str, int]]:
        return []  # the fake parks nothing

    def save_parked_session(self, entry_id: int, filename: str) -> SessionResult:
        self.session_calls.append(("save_parked", entry_id, filename))
        if self.config.session_dir is None:
            raise SessionFilesDisabled()
        raise BadRequest(f"no parked conversation {entry_id}", "id")

    def stats(self) -> dict[str, Any]:
        busy = [h for h in self.lanes.values() if h is not None]
        used = sum(len(h.prompt_ids) + h.events_sent for h in busy)
        tokens = {i: self.held.get(i, 0) if h is None else len(h.prompt_ids) for i, h in self.lanes.items()}
        return {
            "pool_cells_total": 4096,
            "pool_cells_holding_tokens": sum(tokens.values()),
            "pool_cells_reserved": used,
            "pool_cells_used": used,
            "pool_cells_free": 4096 - used,
            "pool_usage_fraction": sum(tokens.values()) / 4096,
            "chunks_per_session": {i: (1 if h is not None else 0) for i, h in self.lanes.items()},
            "tokens_per_session": tokens,
            "lanes_total": len(self.lanes),
            "lanes_busy": len(busy),
            "lanes_idle": len(self.lanes) - len(busy),
            "queue_length": 0,
            "prefix_reuse_hits": self.prefix_reuse_hits,
            "prefix_tokens_reused": 0,
            "refusals": self.refusals,
            "truncations": self.truncations,
            "kv_format": "bf16",
            "pool_shared": True,
            "conversation_cache": self.conversation_cache,
        }

    def close(self) -> None:
        self.closed = True
