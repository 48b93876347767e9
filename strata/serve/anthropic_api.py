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
from strata.serve.reasoning import ThinkSplitter, prompt_opens_thinking
from strata.serve.request_body import read_body
from strata.serve.schemas_anthropic import (
    IGNORED_ANTHROPIC,
    UNSUPPORTED_MESSAGES,
    CountTokensRequest,
    MessagesRequest,
    PromptFields,
    ThinkingEnabled,
    ToolResultBlock,
    ToolUseBlock,
)
from strata.serve.state import ServeState, request_info, serve_state
from strata.serve.tool_use import ChatSetup, ToolRequest, chat_setup, new_id
from strata.serve.tools import (
    ArgsPiece,
    CallStart,
    TextPiece,
    Tool,
    ToolCall,
    ToolStream,
    assistant_with_calls,
    tool_result,
)

router = APIRouter()


def _event(name: str, body: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def _template_messages(req: PromptFields) -> list[dict[str, Any]]:
    """System first, then each turn; tool_use and tool_result blocks in transformers' shape.

    A user turn's tool results come first (the API puts them there), each as
    its own `tool` message; an error result says so in its text, since
    templates have no flag for it.
    """
    messages: list[dict[str, Any]] = []
    system = req.system_text()
    if system is not None:
        messages.append({"role": "system", "content": system})
    names: dict[str, str] = {}
    for m in req.messages:
        blocks = m.blocks()
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        for r in results:
            text = r.text()
            messages.append(tool_result(r.tool_use_id, names.get(r.tool_use_id, ""),
                                        f"Error: {text}" if r.is_error else text))
        uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
        if results and not m.text():
            continue
        if uses:
            calls = [ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False)) for b in uses]
            names.update((c.id, c.name) for c in calls)
            item = assistant_with_calls(m.text(), calls)
        else:
            item = {"role": m.role, "content": m.text()}
        thinking = m.thinking()
        if thinking is not None:
            item["reasoning_content"] = thinking
        messages.append(item)
    return messages


def _tool_request(req: PromptFields) -> ToolRequest | None:
    if not req.tools:
        return None
    tools = [Tool(t.name, t.description, t.input_schema) for t in req.tools]
    choice = req.tool_choice
    if choice is None:
        return ToolRequest(tools)
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return ToolRequest(tools, "auto", choice.name, parallel)
    return ToolRequest(tools, "required" if choice.type == "any" else choice.type, None, parallel)


async def _render(state: ServeState, req: PromptFields) -> tuple[str, list[int], ChatSetup, dict[str, Any]]:
    """The prompt text and ids, what the answer's parsing and grammar need, and the template's
    arguments."""
    engine = state.ready_engine()
    answering = isinstance(req, MessagesRequest)  # count_tokens only renders
    schema = req.output_format() if answering else None
    setup = await chat_setup(engine, _template_messages(req), _tool_request(req), schema,
                             "output_config.format", constrain=answering)
    kwargs: dict[str, Any] = dict(setup.template_kwargs)
    enable = req.enable_thinking()
    if enable is not None:
        kwargs["enable_thinking"] = enable
    text = await g.render_chat(engine, setup.messages, kwargs, tools=setup.template_tools)
    return text, await g.encode(engine, text, add_special_tokens=False), setup, kwargs


def _stop_reason(event: StreamEvent, calls: bool = False) -> tuple[str, str | None]:
    if event.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if event.stop_string is not None:
        return "stop_sequence", event.stop_string
    return ("tool_use" if calls else "end_turn"), None


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}


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
    req = await read_body(request, CountTokensRequest, UNSUPPORTED_MESSAGES, IGNORED_ANTHROPIC)
    _, ids, _, _ = await _render(state, req)
    return JSONResponse({"input_tokens": len(ids)})


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    state = serve_state(request)
    req = await read_body(request, MessagesRequest, UNSUPPORTED_MESSAGES, IGNORED_ANTHROPIC)
    request_info(request)["user"] = req.metadata.user_id if req.metadata else None
    prompt_text, prompt_ids, setup, kwargs = await _render(state, req)
    max_tokens = g.fit_max_tokens(len(prompt_ids), req.max_tokens, state.max_context(), "max_tokens")
    cuts = await g.cut_points(state.ready_engine(), setup.messages, kwargs, setup.template_tools, prompt_text,
                              prompt_ids)
    params = state.sampling.params(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences,
        grammar=setup.grammar,
        cut_points=cuts,
    )
    opens = prompt_opens_thinking(prompt_text)
    budget = req.thinking.budget_tokens if isinstance(req.thinking, ThinkingEnabled) else None
    gen = g.Generation.for_request(request, state, prompt_ids, params, starts_in_thinking=opens,
                                   thinking_budget=budget)
    await g.start(request, gen, stream=req.stream)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    splitter = ThinkSplitter(opens)
    omit = req.omit_thinking()
    ids = new_id("toolu_")
    if req.stream:
        blocks = _Blocks(omit, setup.stream(ids))
        return g.sse(gen, _stream(request, gen, splitter, mid, state, blocks))
    out = await g.collect_all(request, gen, splitter)
    parsed = setup.parse(out.content, ids)
    content: list[dict[str, Any]] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": "" if omit else out.reasoning, "signature": ""})
    if parsed.content or not parsed.calls:
        content.append({"type": "text", "text": parsed.content})
    content += [_tool_use(c) for c in parsed.calls]
    reason, sequence = _stop_reason(out.final, bool(parsed.calls))
    body: dict[str, Any] = {
        "id": mid, "type": "message", "role": "assistant", "model": state.model_name,
        "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(gen),
    }
    if out.final.truncated:
        body["truncated"] = True
    return JSONResponse(body)


class _Blocks:
    """Opens and closes content blocks as the kind of output changes: thinking, text, tool calls."""

    def __init__(self, omit_thinking: bool, tools: ToolStream | None) -> None:
        self.index = -1
        self.kind: str | None = None
        self.omit_thinking = omit_thinking  # thinking blocks are opened and closed, never filled
        self.tools = tools
        self.calls = 0

    def piece(self, kind: str, text: str) -> list[str]:
        if kind == "reasoning":
            if self.omit_thinking:
                return self._switch("thinking")
            return self._switch("thinking") + [self._delta({"type": "thinking_delta", "thinking": text})]
        if self.tools is None:
            return self._text(text)
        return self._tool_pieces(self.tools.feed(text))

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        return self._switch("text") + [self._delta({"type": "text_delta", "text": text})]

    def _tool_pieces(self, pieces: list[Any]) -> list[str]:
        out: list[str] = []
        for p in pieces:
            if isinstance(p, TextPiece):
                out += self._text(p.text)
            elif isinstance(p, CallStart):
                self.calls += 1
                out += self.close() + self._open("tool_use", {"type": "tool_use", "id": p.id,
                                                              "name": p.name, "input": {}})
            elif isinstance(p, ArgsPiece):
                out.append(self._delta({"type": "input_json_delta", "partial_json": p.fragment}))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                              "delta": delta})

    def _switch(self, block_type: str) -> list[str]:
        if self.kind == block_type:
            return []
        block: dict[str, Any] = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if block_type == "thinking" else {"type": "text", "text": ""}
        )
        return self.close() + self._open(block_type, block)

    def _open(self, block_type: str, block: dict[str, Any]) -> list[str]:
        self.index += 1
        self.kind = block_type
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
        out = self._tool_pieces(self.tools.finish()) if self.tools is not None else []
        if self.index < 0:
            out += self._switch("text")
        return out + self.close()


PING = _event("ping", {"type": "ping"})  # the API's own keep-alive; every SDK skips it


def _stream(
    request: Request, gen: g.Generation, splitter: ThinkSplitter, mid: str, state: ServeState,
    blocks: _Blocks,
) -> AsyncIterator[str]:
    usage = _usage(gen)
    usage["output_tokens"] = 0
    head = [_event("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": state.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage,
    }})]

    def each(event: StreamEvent) -> Iterator[str]:
        for kind, text in g.split_event(splitter, event):
            yield from blocks.piece(kind, text)

    def tail() -> list[str]:
        assert gen.final is not None
        closing = blocks.finish()
        reason, sequence = _stop_reason(gen.final, blocks.calls > 0)
        delta: dict[str, Any] = {"stop_reason": reason, "stop_sequence": sequence}
        if gen.final.truncated:
            delta["truncated"] = True
        end = {"type": "message_delta", "delta": delta, "usage": _usage(gen)}
        stop = _event("message_stop", {"type": "message_stop"})
        return closing + [_event("message_delta", end), stop]

    return g.event_stream(request, gen, head, each, tail, beat=PING, every=state.keepalive_s)
