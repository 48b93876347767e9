"""A request inside the engine, and the handle its caller reads events from.

The engine loop runs in its own thread. A handle created inside a running
asyncio event loop delivers events through that loop (for the server); one
created elsewhere delivers them through a blocking queue (CLI, tests).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Iterator

import torch

from strata.engine.types import FinishReason, SamplingParams, StreamEvent

if TYPE_CHECKING:
    from llguidance import LLMatcher

_ids = itertools.count(1)
_END = object()


class RequestHandle:
    """Events of one request: iterate (blocking) or async-iterate; `cancel()` to stop it."""

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self._cancel = threading.Event()
        self._wake = None  # the engine's wake-up callback, set on submission
        self.lane: int | None = None  # the lane serving the request, from admission on (`placed`)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._aq: asyncio.Queue | None = asyncio.Queue() if self._loop else None
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    # ---- engine side ----
    def placed(self, lane: int) -> None:
        """The scheduler admitted the request to `lane` (answers name it: llama-server's id_slot)."""
        self.lane = lane

    def _put(self, item: object) -> None:
        if self._loop is not None:
            assert self._aq is not None
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
            except RuntimeError:  # the caller's loop is gone: nobody is listening
                pass
        else:
            self._q.put(item)

    def publish(self, event: StreamEvent) -> None:
        self._put(event)
        if event.finish_reason is not None:
            self._put(_END)

    def fail(self, error: Exception) -> None:
        self._put(error)
        self._put(_END)

    # ---- caller side ----
    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop generating; the lane is freed within one engine step."""
        self._cancel.set()
        if self._wake is not None:
            self._wake()

    def __iter__(self) -> Iterator[StreamEvent]:
        if self._loop is not None:
            raise RuntimeError("this handle was created in an event loop: use `async for`")
        while True:
            item = self._q.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item  # type: ignore[misc]

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        if self._aq is None:
            raise RuntimeError("this handle was created outside an event loop: use `for`")
        while True:
            item = await self._aq.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item  # type: ignore[misc]

    def result(self) -> StreamEvent:
        """Run to the end and return one event holding all text, token ids and logprobs."""
        events = list(self)
        return merge_events(events)


def merge_events(events: list[StreamEvent]) -> StreamEvent:
    last = events[-1]
    return StreamEvent(
        text="".join(e.text for e in events),
        token_ids=[t for e in events for t in e.token_ids],
        finish_reason=last.finish_reason,
        truncated=last.truncated,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        logprobs=[lp for e in events for lp in e.logprobs],
        stop_string=last.stop_string,
    )


@dataclass
class Request:
    """Engine-side state of one request."""

    prompt: list[int]
    params: SamplingParams
    handle: RequestHandle
    generator: torch.Generator | None = None
    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    cursor: int = 0  # prompt tokens whose K/V is in the lane
    cached: int = 0  # prompt tokens reused from a cached conversation
    cuts: list[int] = field(default_factory=list)  # positions where the read stops to checkpoint
    # a recurrent model's state (engine/checkpoints.py)
    finish: FinishReason | None = None
    detok: object = None  # IncrementalDetokenizer
    stopper: object = None  # StopMatcher
    matcher: LLMatcher | None = None  # the matcher of the request's grammar, if it has one

    @property
    def prefilling(self) -> bool:
        return self.cursor < len(self.prompt)
