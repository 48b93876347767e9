"""Noticing a client that went away, and server-sent events that stop when it does.

A request waiting on the engine sends nothing for a while (queued, or reading
a long prompt), so a disconnect cannot be noticed by a failed write alone: a
watcher listens for `http.disconnect` on the ASGI receive channel beside the
work and cancels it, and the caller's `on_disconnect` frees the engine lane.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
log = logging.getLogger("strata.serve")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(
    receive: Receive, work: Awaitable[T], on_disconnect: Callable[[], None]
) -> T:
    """Run `work` until it finishes or the client disconnects (then ClientDisconnected)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        watch_task.cancel()
        on_disconnect()
        raise
    if work_task in done:
        watch_task.cancel()
        return work_task.result()
    on_disconnect()
    work_task.cancel()
    try:
        await work_task
    except BaseException:  # the work's own end (cancelled or failed) no longer matters
        pass
    raise ClientDisconnected()


async def with_heartbeat(
    events: AsyncIterator[T], every: float, beat: Callable[[], str]
) -> AsyncIterator[T | str]:
    """`events`, with `beat()` yielded whenever nothing came for `every` seconds.

    A stream waiting on a long prompt read sends nothing for minutes; proxies
    and SDK read timeouts give up on a silent connection long before that.
    The pending read is never cancelled by a beat, only by the end of the stream.
    """
    it = events.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield beat()
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except BaseException:  # the read's own end no longer matters
                pass


class SSEResponse(Response):
    """A text/event-stream response whose producer is cancelled when the client leaves.

    `on_close` runs however the stream ends (complete, disconnected, failed), so
    the engine handle is always released.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[], None],
        on_disconnect: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await race_disconnect(receive, self._pump(send), self.on_disconnect)
        except ClientDisconnected:
            pass  # nothing more can be sent; on_disconnect already freed the lane
        except OSError:
            self.on_disconnect()  # a write failed: the client is gone
        finally:
            self.on_close()
            await _aclose(self.events)


async def _aclose(events: AsyncIterator[str]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # a generator failing while closing must not hide the response's end
            log.exception("closing an event stream failed")
