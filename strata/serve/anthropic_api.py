"""Anthropic endpoints: /v1/messages (streaming and not) and /v1/messages/count_tokens.

The event stream follows Anthropic's order: message_start, then per content
block content_block_start (a ping after the first), deltas, content_block_stop;
then message_delta with the stop reason and usage, and message_stop.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from strata.engine.types import FinishReason, StreamEvent
from strata.serve import generation as g
from strata.serve.request_body import read_body
from strata.serve.reasoning import ThinkSplitter, prompt_opens_thinking
from strata.serve.schemas_anthropic import (
    UNSUPPORTED_MESSAGES,
    CountTokensRequest,
    MessagesRequest,
    ThinkingEnabled,
    PromptFields,
)
from strata.serve.state import ServeState, request_info, serve_state

router = APIRouter()


def _event(name: str, body: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _render(state: ServeState, req: PromptFields) -> tuple[str, list[int]]:
    """The prompt text and ids: system first, earlier thinking kept for templates that use it."""
    engine = state.ready_engine()
    messages: list[dict[str, Any]] = []
    system = req.system_text()
    if system is not None:
        messages.append({"role": "system", "content": system})
    for m in req.messages:
        item: dict[str, Any] = {"role": m.role, "content": m.text()}
        thinking = m.thinking()
        if thinking is not None:
            item["reasoning_content"] = thinking
        messages.append(item)
    kwargs: dict[str, Any] = {}
    enable = req.enable_thinking()
    if enable is not None:
        kwargs["enable_thinking"] = enable
    text = await g.render_chat(engine, messages, kwargs)
    return text, await g.encode(engine, text, add_special_tokens=False)


def _stop_reason(event: StreamEvent) -> tuple[str, str | None]:
    if event.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if event.stop_string is not None:
        return "stop_sequence", event.stop_string
    return "end_turn", None


def _usage(gen: g.Generation) -> dict[str, Any]:
    """Anthropic counts cache reads apart from input_tokens; the sum is the prompt."""
    return {
        "input_tokens": gen.prompt_tokens - gen.cached_tokens,
        "output_tokens": gen.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": gen.cached_tokens,
    }


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    state = serve_state(request)
    req = await read_body(request, CountTokensRequest, UNSUPPORTED_MESSAGES)
    _, ids = await _render(state, req)
    return JSONResponse({"input_tokens": len(ids)})


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    state = serve_state(request)
    req = await read_body(request, MessagesRequest, UNSUPPORTED_MESSAGES)
    request_info(request)["user"] = req.metadata.user_id if req.metadata else None
    prompt_text, prompt_ids = await _render(state, req)
    max_tokens = g.fit_max_tokens(len(prompt_ids), req.max_tokens, state.max_context(), "max_tokens")
    params = g.sampling_params(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences,
    )
    opens = prompt_opens_thinking(prompt_text)
    budget = req.thinking.budget_tokens if isinstance(req.thinking, ThinkingEnabled) else None
    gen = g.Generation.for_request(request, state, prompt_ids, params, starts_in_thinking=opens,
                                   thinking_budget=budget)
    await g.start(request, gen)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    splitter = ThinkSplitter(opens)
    omit = req.omit_thinking()
    if req.stream:
        return g.sse(gen, _stream(request, gen, splitter, mid, state.model_name, omit))
    out = await g.collect_all(request, gen, splitter)
    content: list[dict[str, Any]] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": "" if omit else out.reasoning, "signature": ""})
    content.append({"type": "text", "text": out.content})
    reason, sequence = _stop_reason(out.final)
    body: dict[str, Any] = {
        "id": mid, "type": "message", "role": "assistant", "model": state.model_name,
        "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(gen),
    }
    if out.final.truncated:
        body["truncated"] = True
    return JSONResponse(body)


class _Blocks:
    """Opens and closes content blocks as the kind of text changes (thinking, then text)."""

    def __init__(self, omit_thinking: bool) -> None:
        self.index = -1
        self.kind: str | None = None
        self.omit_thinking = omit_thinking  # thinking blocks are opened and closed, never filled

    def piece(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        block_type = "thinking" if kind == "reasoning" else "text"
        if self.kind != block_type:
            out += self.close()
            out += self._open(block_type)
        if block_type == "thinking":
            if self.omit_thinking:
                return out
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": delta}))
        return out

    def _open(self, block_type: str) -> list[str]:
        self.index += 1
        self.kind = block_type
        block: dict[str, Any] = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if block_type == "thinking" else {"type": "text", "text": ""}
        )
        out = [_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                              "content_block": block})]
        if self.index == 0:
            out.append(_event("ping", {"type": "ping"}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def finish(self) -> list[str]:
        """Close the last block; a message always has at least its (possibly empty) text block."""
        out = self._open("text") if self.index < 0 else []
        return out + self.close()


def _stream(
    request: Request, gen: g.Generation, splitter: ThinkSplitter, mid: str, model: str, omit: bool
) -> AsyncIterator[str]:
    usage = _usage(gen)
    usage["output_tokens"] = 0
    head = [_event("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage,
    }})]
    blocks = _Blocks(omit)

    def each(event: StreamEvent) -> Iterator[str]:
        for kind, text in g.split_event(splitter, event):
            yield from blocks.piece(kind, text)

    def tail() -> list[str]:
        assert gen.final is not None
        reason, sequence = _stop_reason(gen.final)
        delta: dict[str, Any] = {"stop_reason": reason, "stop_sequence": sequence}
        if gen.final.truncated:
            delta["truncated"] = True
        end = {"type": "message_delta", "delta": delta, "usage": _usage(gen)}
        stop = _event("message_stop", {"type": "message_stop"})
        return blocks.finish() + [_event("message_delta", end), stop]

    return g.event_stream(request, gen, head, each, tail)
