"""OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Each is also served without the /v1 prefix, as llama-server serves them, and
every answer carries llama-server's `timings` (the body, or a stream's
finishing chunk): the SDKs keep fields they do not know.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from strata.engine.sampling_defaults import SamplingDefaults
from strata.engine.types import SamplingParams, StreamEvent
from strata.serve import generation as g
from strata.serve import llama_format as llama_fmt
from strata.serve import openai_format as fmt
from strata.serve.errors import ApiError
from strata.serve.reasoning import ThinkSplitter, prompt_opens_thinking
from strata.serve.request_body import read_body
from strata.serve.schemas_openai import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    IGNORED_OPENAI,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETIONS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from strata.serve.state import ServeState, request_info, serve_state
from strata.serve.tool_use import ChatSetup, ToolRequest, chat_setup, new_id
from strata.serve.tools import (
    CallStart,
    Tool,
    ToolCall,
    ToolStream,
    assistant_with_calls,
    tool_result,
)

router = APIRouter()

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: every SDK skips it, every proxy sees traffic
DONE = "data: [DONE]\n\n"  # a stream's last line, after a good end or an error event alike


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What chat templates expect (transformers' conventions for tool calls and results)."""
    names: dict[str, str] = {}  # call id -> tool name, for results that do not repeat it
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            assert m.tool_call_id is not None
            out.append(tool_result(m.tool_call_id, m.name or names.get(m.tool_call_id, ""), m.text()))
            continue
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
            names.update((c.id, c.name) for c in calls)
            item = assistant_with_calls(m.text(), calls)
        if m.name is not None:
            item["name"] = m.name
        if m.reasoning_content is not None:
            item["reasoning_content"] = m.reasoning_content
        out.append(item)
    return out


def _tool_request(req: ChatCompletionRequest) -> ToolRequest | None:
    if not req.tools:
        return None
    tools = [Tool(t.function.name, t.function.description, t.function.parameters or {"type": "object"})
             for t in req.tools]
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        return ToolRequest(tools, "auto", choice.function.name, parallel)
    return ToolRequest(tools, choice or "auto", None, parallel)


def _params(defaults: SamplingDefaults, req: SamplingFields, max_tokens: int, logprobs: int | None,
            grammar: str | None = None, cut_points: list[int] | None = None) -> SamplingParams:
    """The request's fields over the server's `defaults`. `cut_points`: the chat's message ends in
    the prompt (`g.cut_points`), for a model that checkpoints there."""
    return defaults.params(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=req.stop_list(),
        logprobs=logprobs,
        grammar=grammar,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop_token_ids=list(req.stop_token_ids or []),
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
        progress=req.return_progress,
        cut_points=list(cut_points or []),
    )


@dataclasses.dataclass(frozen=True)
class _Reply:
    """What every body and chunk of one answer repeats: id, object type, creation time, model."""

    id: str
    object: str
    created: int
    model: str
    include_usage: bool = False  # streams: every chunk has "usage", null until the last one

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def response(self, choice: dict[str, Any], gen: g.Generation) -> JSONResponse:
        return JSONResponse({
            **self._head(), "choices": [choice], "usage": fmt.usage(gen),
            "system_fingerprint": None, "timings": llama_fmt.timings(gen),
        })

    def chunk(self, choice: dict[str, Any], gen: g.Generation | None = None) -> str:
        """One chunk; the finishing one (`gen` given) adds llama-server's timings."""
        body: dict[str, Any] = {**self._head(), "system_fingerprint": None, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        if gen is not None:
            body["timings"] = llama_fmt.timings(gen)
        return _data(body)

    def extra(self, fields: dict[str, Any]) -> str:
        """A chunk with no choices that carries `fields` (llama.cpp's prompt_progress)."""
        return _data({**self._head(), "system_fingerprint": None, "choices": [], **fields})

    def tail(self, gen: g.Generation) -> list[str]:
        """A stream's closing lines after a good end: the usage chunk if asked for, then [DONE]."""
        if not self.include_usage:
            return [DONE]
        body = {**self._head(), "system_fingerprint": None, "choices": [], "usage": fmt.usage(gen)}
        return [_data(body), DONE]


def _choice(
    fields: dict[str, Any], logprobs: Any, final: StreamEvent | None = None, calls: bool = False
) -> dict[str, Any]:
    """The one choice (n=1) around `fields`; finish fields once `final`, the last event, is in."""
    if final is None:
        return {"index": 0, **fields, "logprobs": logprobs, "finish_reason": None}
    reason = fmt.finish_reason(final)
    return {"index": 0, **fields, "logprobs": logprobs,
            "finish_reason": "tool_calls" if calls and reason == "stop" else reason,
            **fmt.chat_choice_extra(final)}


def _with_stop_string(event: StreamEvent, include: bool) -> StreamEvent:
    """vLLM's include_stop_str_in_output: the stop string that ended the answer is part of it."""
    if include and event.stop_string is not None:
        return dataclasses.replace(event, text=event.text + event.stop_string)
    return event


async def _chat_setup(engine: Any, req: ChatCompletionRequest) -> ChatSetup:
    schema = req.response_format.answer_schema() if req.response_format is not None else None
    return await chat_setup(engine, _template_messages(req.messages), _tool_request(req), schema,
                            "response_format")


async def chat_prompt(engine: Any, req: ChatCompletionRequest) -> tuple[ChatSetup, dict[str, Any], str]:
    """A chat request's setup, template arguments and prompt text: what the model is shown
    (also llama-server's /apply-template answer)."""
    setup = await _chat_setup(engine, req)
    kwargs = {**setup.template_kwargs, **(req.chat_template_kwargs or {})}
    prompt_text = await g.render_chat(engine, setup.messages, kwargs, tools=setup.template_tools,
                                      add_generation_prompt=req.add_generation_prompt)
    return setup, kwargs, prompt_text


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = serve_state(request)
    req = await read_body(request, ChatCompletionRequest, UNSUPPORTED_CHAT, IGNORED_OPENAI)
    engine = state.ready_engine()
    request_info(request)["user"] = req.user
    setup, kwargs, prompt_text = await chat_prompt(engine, req)
    prompt_ids = await g.encode(engine, prompt_text, add_special_tokens=False)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = g.fit_max_tokens(len(prompt_ids), req.wanted_max_tokens(), state.max_context(), field)
    top = req.top_logprobs or 0
    cuts = await g.cut_points(engine, setup.messages, kwargs, setup.template_tools, prompt_text, prompt_ids)
    params = _params(state.sampling, req, max_tokens, req.wanted_logprobs(), setup.grammar, cuts)
    gen = g.Generation.for_request(request, state, prompt_ids, params)
    splitter = ThinkSplitter(prompt_opens_thinking(prompt_text))
    await g.start(request, gen, stream=req.stream)
    kind = "chat.completion.chunk" if req.stream else "chat.completion"
    reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", kind, int(time.time()), state.model_name,
                   req.include_usage())
    ids = new_id("call_")
    if req.stream:
        chunks = _ChatChunks(reply, setup.stream(ids), req, top, gen)
        return g.sse(gen, g.event_stream(request, gen, [chunks.head()], lambda e: chunks.each(splitter, e),
                                         lambda: reply.tail(gen), beat=KEEPALIVE, every=state.keepalive_s,
                                         after_error=[DONE]))
    out = await g.collect_all(request, gen, splitter)
    stop = out.final.stop_string if req.include_stop_str_in_output else None
    parsed = setup.parse(out.content + (stop or ""), ids)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
    if parsed.calls:
        message["content"] = parsed.content or None
        message["tool_calls"] = [fmt.tool_call(c) for c in parsed.calls]
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    lps = fmt.chat_logprobs(out.logprobs, top) if req.logprobs else None
    return reply.response(_choice({"message": message}, lps, out.final, bool(parsed.calls)), gen)


class _ChatChunks:
    """The chunks of one streamed chat answer: reasoning, content and tool-call deltas."""

    def __init__(self, reply: _Reply, tools: ToolStream | None, req: ChatCompletionRequest, top: int,
                 gen: g.Generation) -> None:
        self.reply = reply
        self.tools = tools
        self.req = req
        self.top = top
        self.calls = 0
        self.gen = gen  # its arrival time (prompt_progress time_ms) and timings

    def chunk(self, delta: dict[str, Any], lps: Any = None, final: StreamEvent | None = None) -> str:
        return self.reply.chunk(_choice({"delta": delta}, lps, final, self.calls > 0),
                                self.gen if final is not None else None)

    def head(self) -> str:
        return self.chunk({"role": "assistant", "content": ""})

    def _content(self, text: str, end: bool) -> list[dict[str, Any]]:
        if self.tools is None:
            return [{"content": text}] if text else []
        pieces = self.tools.feed(text) + (self.tools.finish() if end else [])
        deltas = []
        for piece in pieces:
            delta = fmt.tool_delta(piece)
            if isinstance(piece, CallStart):
                self.calls += 1
            if delta is not None:
                deltas.append(delta)
        return deltas

    def each(self, splitter: ThinkSplitter, event: StreamEvent) -> Iterator[str]:
        if event.progress is not None:
            if self.req.return_progress:
                yield self.reply.extra({"prompt_progress": fmt.prompt_progress(event.progress, self.gen.started)})
            return
        event = _with_stop_string(event, self.req.include_stop_str_in_output)
        end = event.finish_reason is not None
        lps = fmt.chat_logprobs(event.logprobs, self.top) if self.req.logprobs and event.logprobs else None
        deltas: list[dict[str, Any]] = []
        for kind, text in g.split_event(splitter, event):
            deltas += [{"reasoning_content": text}] if kind == "reasoning" else self._content(text, False)
        if end:
            deltas += self._content("", True)
        for delta in deltas:
            yield self.chunk(delta, lps)
            lps = None
        if lps is not None:  # logprobs of tokens whose text is still held back
            yield self.chunk({"content": ""}, lps)
        if end:
            yield self.chunk({}, final=event)


async def _completion_prompt(state: ServeState, req: CompletionRequest) -> list[int]:
    engine = state.ready_engine()
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = [int(t) for t in prompt]
        vocab = getattr(engine.tokenizer, "vocab_size", None)
        bad = [t for t in ids if t < 0 or (isinstance(vocab, int) and t >= vocab)]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary", param="prompt")
        return ids
    text = prompt if isinstance(prompt, str) else str(prompt[0])
    return await g.encode(engine, text, add_special_tokens=True)


@router.post("/v1/completions")
@router.post("/completions")
async def completions(request: Request) -> Response:
    state = serve_state(request)
    req = await read_body(request, CompletionRequest, UNSUPPORTED_COMPLETIONS, IGNORED_OPENAI)
    request_info(request)["user"] = req.user
    prompt_ids = await _completion_prompt(state, req)
    wanted = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    max_tokens = g.fit_max_tokens(len(prompt_ids), wanted, state.max_context(), "max_tokens")
    params = _params(state.sampling, req, max_tokens, req.logprobs)
    gen = g.Generation.for_request(request, state, prompt_ids, params)
    await g.start(request, gen, stream=req.stream)
    reply = _Reply(f"cmpl-{uuid.uuid4().hex}", "text_completion", int(time.time()),
                   state.model_name, req.include_usage())
    top = req.logprobs or 0
    if req.stream:
        return g.sse(gen, _completion_stream(request, gen, reply, req, top, state.keepalive_s))
    out = await g.collect_all(request, gen, None)
    lps = fmt.completion_logprobs(out.logprobs, top) if req.logprobs is not None else None
    stop = out.final.stop_string if req.include_stop_str_in_output else None
    return reply.response(_choice({"text": out.content + (stop or "")}, lps, out.final), gen)


def _completion_stream(
    request: Request, gen: g.Generation, reply: _Reply, req: CompletionRequest, top: int, every: float
) -> AsyncIterator[str]:
    offset = 0  # of the next token in the whole completion's text, for text_offset
    logprobs = req.logprobs is not None
    started = gen.started

    def each(event: StreamEvent) -> Iterator[str]:
        nonlocal offset
        if event.progress is not None:
            if req.return_progress:
                yield reply.extra({"prompt_progress": fmt.prompt_progress(event.progress, started)})
            return
        event = _with_stop_string(event, req.include_stop_str_in_output)
        lps = fmt.completion_logprobs(event.logprobs, top, offset) if logprobs else None
        offset += sum(len(lp.text) for lp in event.logprobs)
        if event.text or lps and lps["tokens"]:
            yield reply.chunk(_choice({"text": event.text}, lps))
        if event.finish_reason is not None:
            yield reply.chunk(_choice({"text": ""}, None, event), gen)

    return g.event_stream(request, gen, [], each, lambda: reply.tail(gen), beat=KEEPALIVE, every=every,
                          after_error=[DONE])


def _model_card(state: ServeState) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "strata",
    }
    if state.engine is not None:
        card["max_model_len"] = int(state.engine.config.max_context)
    return card


@router.get("/v1/models")
@router.get("/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(serve_state(request))]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> JSONResponse:
    state = serve_state(request)
    if model_id != state.model_name:
        raise ApiError(404, f"The model '{model_id}' does not exist; this server serves "
                            f"'{state.model_name}'", param="model", code="model_not_found")
    return JSONResponse(_model_card(state))
