"""One engine request as both APIs need it: prompt, limits, refusals, usage, timing.

The dialect modules (openai_api, anthropic_api) only shape JSON; everything
about talking to the engine lives here once: rendering and tokenizing off the
event loop, the max_context check that names both numbers, turning the first
event's refusal into a 503 before any byte is sent, ending a started stream
with an error event, counting tokens, feeding the latency histograms, and
always releasing the engine's handle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from strata.engine.types import FinishReason, SamplingParams, StreamEvent, TokenLogprob
from strata.errors import StrataError
from strata.serve.cut_points import message_cut_points
from strata.serve.errors import ApiError, from_strata_error, sse_error_payload
from strata.serve.metrics import ServeMetrics
from strata.serve.reasoning import CLOSE_TAG, ThinkSplitter
from strata.serve.state import ServeState, request_info
from strata.serve.streaming import SSEResponse, race_disconnect, with_heartbeat

log = logging.getLogger("strata.serve")

# Appended to a thinking block that reached its budget, so the answer can begin.
FORCED_CLOSE = f"\n{CLOSE_TAG}\n\n"


def as_api_error(exc: Exception) -> ApiError:
    """The engine's typed error as HTTP, or a logged 500 for anything unexpected."""
    if isinstance(exc, ApiError):
        return exc
    mapped = from_strata_error(exc)
    if mapped is not None:
        return mapped
    log.error("engine error: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def tokenizer_of(engine: Any) -> Any:
    """The engine's tokenizer; its absence is the server's problem, not the client's."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        raise ApiError(500, "the loaded model has no tokenizer, so text requests cannot be served",
                       code="no_tokenizer")
    return tokenizer


async def render_chat(
    engine: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any], *,
    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
) -> str:
    """The chat template applied off the event loop; a template's complaint is the client's 400."""
    tokenizer = tokenizer_of(engine)

    def render() -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=tools, **template_kwargs)

    try:
        return await run_in_threadpool(render)
    except StrataError as exc:  # the tokenizer's BadRequest: raise_exception, no template, ...
        raise as_api_error(exc) from None
    except TypeError as exc:  # chat_template_kwargs naming one of the template's own arguments
        raise ApiError(400, f"chat_template_kwargs not accepted: {exc}", param="chat_template_kwargs") from None


async def cut_points(engine: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any],
                     tools: list[dict[str, Any]] | None, prompt_text: str, prompt_ids: list[int]) -> list[int]:
    """The chat's message ends in the prompt, for an engine that checkpoints there (a recurrent
    model's); none for any other."""
    if not getattr(engine, "wants_cut_points", False):
        return []
    return await run_in_threadpool(message_cut_points, tokenizer_of(engine), messages, template_kwargs,
                                   tools, prompt_text, prompt_ids)


async def encode(engine: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    return await run_in_threadpool(tokenizer_of(engine).encode, text, add_special_tokens=add_special_tokens)


def fit_max_tokens(prompt_len: int, max_tokens: int | None, max_context: int, field: str) -> int:
    """The tokens to generate; a 400 naming both numbers when they cannot fit."""
    if prompt_len >= max_context:
        raise ApiError(
            400,
            f"the prompt is {prompt_len} tokens but --max-context is {max_context}: "
            "nothing is left to generate",
            param="messages",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_context - prompt_len
    if prompt_len + max_tokens > max_context:
        raise ApiError(
            400,
            f"prompt ({prompt_len} tokens) plus {field} ({max_tokens}) is {prompt_len + max_tokens} "
            f"tokens, more than --max-context ({max_context})",
            param=field,
            code="context_length_exceeded",
        )
    return max_tokens


class Generation:
    """One request's life in the engine, from submission to the last event."""

    def __init__(
        self,
        engine: Any,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        metrics: ServeMetrics,
        info: dict[str, Any],
        started: float,
        starts_in_thinking: bool = False,
        thinking_budget: int | None = None,
    ) -> None:
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.params = params
        self.metrics = metrics
        self.info = info
        self.started = started
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.generated_ids: list[int] = []
        self.final: StreamEvent | None = None
        self._budget = thinking_budget
        self._think = ThinkSplitter(starts_in_thinking) if thinking_budget is not None else None
        self._thinking_tokens = 0
        self._handle: Any = None
        self._iter: AsyncIterator[StreamEvent] | None = None
        self._pending: StreamEvent | None = None
        self._first: asyncio.Future | None = None  # the first event, still on its way
        self._handle_tokens = 0
        self._base_tokens = 0  # completion tokens of earlier handles (after a forced close)
        self.first_token_time: float | None = None  # monotonic; prompt time ends here (timings)
        self.last_token_time: float | None = None
        self._closed = False

    @classmethod
    def for_request(
        cls, request: Request, state: ServeState, prompt_ids: list[int], params: SamplingParams,
        **kw: Any,
    ) -> Generation:
        """A generation timed from the request's arrival and logged in its access-log record."""
        info = request_info(request)
        return cls(
            state.ready_engine(), prompt_ids, params, metrics=state.metrics, info=info,
            started=info.get("t0", time.monotonic()), **kw,
        )

    @property
    def lane(self) -> int | None:
        """The engine lane serving the request, once it is admitted (llama-server's id_slot)."""
        return None if self._handle is None else self._handle.lane

    async def start(self, wait: float | None = None) -> None:
        """Submit and read the first event: a refusal by then is the client's status code.

        With `wait` (streams), the first event is awaited that long at most: a
        refusal the engine gives at once still gets its status code, but a
        long queue or prompt read no longer holds the response's headers back.
        """
        self._open(self.prompt_ids, self.params)
        first = asyncio.ensure_future(self._next())
        if wait is not None:
            done, _ = await asyncio.wait({first}, timeout=wait)
            if not done:
                self._first = first
                return
        self._note_first(await first)

    def _note_first(self, event: StreamEvent | None) -> None:
        self._pending = event
        if event is not None:
            self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
            self.cached_tokens = event.cached_tokens

    def _open(self, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            self._handle = self.engine.generate(prompt_ids, params)
            self._iter = self._handle.__aiter__()
        except Exception as exc:  # a refusal at submission (overloaded, ...) is the client's answer
            raise as_api_error(exc) from None

    async def _submit(self, prompt_ids: list[int], params: SamplingParams) -> StreamEvent | None:
        self._open(prompt_ids, params)
        return await self._next()

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Every event to the last; raises ApiError for a failure mid-way."""
        assert self._iter is not None, "start() first"
        if self._first is not None:  # a stream that did not wait for its first event
            first, self._first = self._first, None
            self._note_first(await first)
        event = self._pending
        while True:
            if event is None:
                event = await self._next()
                if event is None:  # the handle ended without a finish: treat as a plain stop
                    log.warning("engine stream ended without a finish reason")
                    event = StreamEvent(text="", token_ids=[], finish_reason=FinishReason.STOP)
            self._account(event)
            if event.finish_reason is not None:
                if event.finish_reason == FinishReason.CANCELLED:
                    raise ApiError(503, "the server cancelled this request", code="cancelled")
                self.final = event
                yield event
                return
            forced = self._maybe_force_close(event)
            yield event
            if forced is not None:
                yield forced
                event = await self._submit(self.prompt_ids + self.generated_ids, self._rest_params())
                continue
            event = None

    async def _next(self) -> StreamEvent | None:
        """The handle's next event, None at its end; an engine failure as an ApiError."""
        assert self._iter is not None
        try:
            return await self._iter.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise as_api_error(exc) from None

    def _account(self, event: StreamEvent) -> None:
        n = len(event.token_ids)
        self.generated_ids.extend(event.token_ids)
        self._handle_tokens = max(self._handle_tokens + n, event.completion_tokens)
        self.completion_tokens = self._base_tokens + self._handle_tokens
        if not n:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.first_token_time = now
            self.metrics.ttft.observe(now - self.started)
            gaps = [0.0] * (n - 1)  # tokens that came with the first one waited no longer
        else:
            gaps = [(now - self.last_token_time) / n] * n
        for gap in gaps:
            self.metrics.itl.observe(gap)
        self.last_token_time = now

    def _maybe_force_close(self, event: StreamEvent) -> StreamEvent | None:
        """End thinking that reached its budget: cancel, then continue after a closing tag."""
        if self._think is None or self._budget is None:
            return None
        was_thinking = self._think.in_reasoning
        self._think.feed(event.text)
        if was_thinking:
            self._thinking_tokens += len(event.token_ids)
        if not self._think.in_reasoning or self._thinking_tokens < self._budget:
            return None
        close_ids = self.engine.tokenizer.encode(FORCED_CLOSE, add_special_tokens=False)
        if self.params.max_tokens - self.completion_tokens - len(close_ids) < 1:
            return None  # no room left for an answer: let max_tokens end it
        self._handle.cancel()
        self._think = None  # thinking is over for good
        self.generated_ids.extend(close_ids)
        self._base_tokens = self.completion_tokens + len(close_ids)
        self._handle_tokens = 0
        self.completion_tokens = self._base_tokens
        # The newline before the tag helps the model; it is not part of what it thought.
        return StreamEvent(text=FORCED_CLOSE.lstrip("\n"), token_ids=[])

    def _rest_params(self) -> SamplingParams:
        return dataclasses.replace(self.params, max_tokens=self.params.max_tokens - self.completion_tokens)

    def cancel(self) -> None:
        """Free the engine lane now (idempotent; a finished request is left alone)."""
        if self._handle is not None and self.final is None:
            self._handle.cancel()
        if self._first is not None:
            self._first.cancel()
            self._first = None

    def disconnected(self) -> None:
        self.cancel()
        self.metrics.disconnects.inc()
        self.info["finish"] = "disconnected"

    def close(self) -> None:
        """Release the handle and record usage once, however the request ended."""
        if self._closed:
            return
        self._closed = True
        self.cancel()
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        self.metrics.cached_tokens.inc(self.cached_tokens)
        self.metrics.generated_tokens.inc(self.completion_tokens)
        self.info.update(prompt=self.prompt_tokens, completion=self.completion_tokens, cached=self.cached_tokens)
        if self.final is not None:
            self.info.setdefault("finish", self.final.finish_reason.value if self.final.finish_reason else None)
            if self.final.truncated:
                self.info["truncated"] = True
        self.metrics.finished(self.info, time.monotonic() - self.started)


@dataclasses.dataclass
class Outcome:
    """A whole answer, for the non-streaming responses."""

    content: str
    reasoning: str
    logprobs: list[TokenLogprob]
    final: StreamEvent


def split_event(splitter: ThinkSplitter, event: StreamEvent) -> list[tuple[str, str]]:
    """An event's text as (kind, text) pieces; the last event also releases any held-back text."""
    pieces = splitter.feed(event.text)
    if event.finish_reason is not None:
        pieces += splitter.flush()
    return pieces


async def collect(gen: Generation, splitter: ThinkSplitter | None) -> Outcome:
    content: list[str] = []
    reasoning: list[str] = []
    logprobs: list[TokenLogprob] = []
    async for event in gen.events():
        logprobs.extend(event.logprobs)
        pieces = split_event(splitter, event) if splitter else [("content", event.text)]
        for kind, text in pieces:
            (reasoning if kind == "reasoning" else content).append(text)
    assert gen.final is not None
    return Outcome("".join(content), "".join(reasoning), logprobs, gen.final)


# How long a stream waits for the engine's first event before sending its headers: long
# enough for a refusal at submission to keep its status code, short enough to be "at once".
STREAM_HEAD_WAIT = 0.25


async def start(request: Any, gen: Generation, *, stream: bool = False) -> None:
    """Submit, watching for the client leaving; the handle is released on any failure."""
    try:
        wait = STREAM_HEAD_WAIT if stream else None
        await race_disconnect(request.receive, gen.start(wait), gen.disconnected)
    except BaseException:
        gen.close()
        raise


async def collect_all(request: Any, gen: Generation, splitter: ThinkSplitter | None) -> Outcome:
    """The whole answer of a non-streaming request (cancelled if the client leaves)."""
    try:
        return await race_disconnect(request.receive, collect(gen, splitter), gen.disconnected)
    finally:
        gen.close()


def sse(gen: Generation, events: AsyncIterator[str]) -> SSEResponse:
    return SSEResponse(events, on_close=gen.close, on_disconnect=gen.disconnected)


async def event_stream(
    request: Any,
    gen: Generation,
    head: Iterable[str],
    each: Callable[[StreamEvent], Iterable[str]],
    tail: Callable[[], Iterable[str]],
    *,
    beat: str,
    every: float,
    after_error: Iterable[str] = (),
) -> AsyncIterator[str]:
    """A streaming answer's SSE lines: head, each event's lines, then tail.

    `beat` is sent whenever the engine has said nothing for `every` seconds
    (a queue or a long prompt read), so the connection stays alive. A failure
    mid-way, a refusal after the headers or a cancellation by a stopping
    server included, ends the stream with an error event in the path's dialect,
    then `after_error` (the OpenAI routes' `[DONE]`, which their clients stop
    reading at), instead of the tail: the 200 status has already been sent.
    """
    for line in head:
        yield line
    try:
        async for event in with_heartbeat(gen.events(), every, lambda: beat):
            if isinstance(event, str):
                yield event
                continue
            for line in each(event):
                yield line
    except ApiError as err:
        yield sse_error_payload(request.url.path, err)
        for line in after_error:
            yield line
        return
    for line in tail():
        yield line
