"""OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from strata.engine.types import StreamEvent
from strata.serve import generation as g
from strata.serve import openai_format as fmt
from strata.serve.errors import ApiError
from strata.serve.request_body import read_body
from strata.serve.reasoning import ThinkSplitter, prompt_opens_thinking
from strata.serve.schemas_openai import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETIONS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from strata.serve.state import ServeState, request_info, serve_state

router = APIRouter()


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """What chat templates expect: developer instructions are system instructions to them."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def _params(req: SamplingFields, max_tokens: int, logprobs: int | None) -> Any:
    return g.sampling_params(
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
            "system_fingerprint": None,
        })

    def chunk(self, choice: dict[str, Any]) -> str:
        body: dict[str, Any] = {**self._head(), "system_fingerprint": None, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return _data(body)

    def tail(self, gen: g.Generation) -> list[str]:
        """A stream's closing lines after a good end: the usage chunk if asked for, then [DONE]."""
        if not self.include_usage:
            return ["data: [DONE]\n\n"]
        body = {**self._head(), "system_fingerprint": None, "choices": [], "usage": fmt.usage(gen)}
        return [_data(body), "data: [DONE]\n\n"]


def _choice(
    fields: dict[str, Any], logprobs: Any, final: StreamEvent | None = None
) -> dict[str, Any]:
    """The one choice (n=1) around `fields`; finish fields once `final`, the last event, is in."""
    if final is None:
        return {"index": 0, **fields, "logprobs": logprobs, "finish_reason": None}
    return {"index": 0, **fields, "logprobs": logprobs, "finish_reason": fmt.finish_reason(final),
            **fmt.chat_choice_extra(final)}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = serve_state(request)
    req = await read_body(request, ChatCompletionRequest, UNSUPPORTED_CHAT)
    engine = state.ready_engine()
    request_info(request)["user"] = req.user
    messages = [_template_message(m) for m in req.messages]
    prompt_text = await g.render_chat(engine, messages, req.chat_template_kwargs or {})
    prompt_ids = await g.encode(engine, prompt_text, add_special_tokens=False)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = g.fit_max_tokens(len(prompt_ids), req.wanted_max_tokens(), state.max_context(), field)
    top = req.top_logprobs or 0
    params = _params(req, max_tokens, req.wanted_logprobs())
    gen = g.Generation.for_request(request, state, prompt_ids, params)
    splitter = ThinkSplitter(prompt_opens_thinking(prompt_text))
    await g.start(request, gen)
    kind = "chat.completion.chunk" if req.stream else "chat.completion"
    reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", kind, int(time.time()), state.model_name,
                   req.include_usage())
    if req.stream:
        return g.sse(gen, _chat_stream(request, gen, splitter, reply, req.logprobs, top))
    out = await g.collect_all(request, gen, splitter)
    message: dict[str, Any] = {"role": "assistant", "content": out.content, "refusal": None}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    lps = fmt.chat_logprobs(out.logprobs, top) if req.logprobs else None
    return reply.response(_choice({"message": message}, lps, out.final), gen)


def _chat_stream(
    request: Request, gen: g.Generation, splitter: ThinkSplitter, reply: _Reply, logprobs: bool,
    top: int,
) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], lps: Any = None, final: StreamEvent | None = None) -> str:
        return reply.chunk(_choice({"delta": delta}, lps, final))

    def each(event: StreamEvent) -> Iterator[str]:
        lps = fmt.chat_logprobs(event.logprobs, top) if logprobs and event.logprobs else None
        for kind, text in g.split_event(splitter, event):
            key = "reasoning_content" if kind == "reasoning" else "content"
            yield chunk({key: text}, lps)
            lps = None
        if lps is not None:  # logprobs of tokens whose text is still held back
            yield chunk({"content": ""}, lps)
        if event.finish_reason is not None:
            yield chunk({}, final=event)

    head = [chunk({"role": "assistant", "content": ""})]
    return g.event_stream(request, gen, head, each, lambda: reply.tail(gen))


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
async def completions(request: Request) -> Response:
    state = serve_state(request)
    req = await read_body(request, CompletionRequest, UNSUPPORTED_COMPLETIONS)
    request_info(request)["user"] = req.user
    prompt_ids = await _completion_prompt(state, req)
    wanted = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    max_tokens = g.fit_max_tokens(len(prompt_ids), wanted, state.max_context(), "max_tokens")
    params = _params(req, max_tokens, req.logprobs)
    gen = g.Generation.for_request(request, state, prompt_ids, params)
    await g.start(request, gen)
    reply = _Reply(f"cmpl-{uuid.uuid4().hex}", "text_completion", int(time.time()),
                   state.model_name, req.include_usage())
    top = req.logprobs or 0
    if req.stream:
        return g.sse(gen, _completion_stream(request, gen, reply, req.logprobs is not None, top))
    out = await g.collect_all(request, gen, None)
    lps = fmt.completion_logprobs(out.logprobs, top) if req.logprobs is not None else None
    return reply.response(_choice({"text": out.content}, lps, out.final), gen)


def _completion_stream(
    request: Request, gen: g.Generation, reply: _Reply, logprobs: bool, top: int
) -> AsyncIterator[str]:
    offset = 0  # of the next token in the whole completion's text, for text_offset

    def each(event: StreamEvent) -> Iterator[str]:
        nonlocal offset
        lps = fmt.completion_logprobs(event.logprobs, top, offset) if logprobs else None
        offset += sum(len(lp.text) for lp in event.logprobs)
        if event.text or lps and lps["tokens"]:
            yield reply.chunk(_choice({"text": event.text}, lps))
        if event.finish_reason is not None:
            yield reply.chunk(_choice({"text": ""}, None, event))

    return g.event_stream(request, gen, [], each, lambda: reply.tail(gen))


def _model_card(state: ServeState) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "strata",
    }
    if state.engine is not None:
        card["max_model_len"] = int(state.engine.config.max_context)
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(serve_state(request))]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> JSONResponse:
    state = serve_state(request)
    if model_id != state.model_name:
        raise ApiError(404, f"The model '{model_id}' does not exist; this server serves "
                            f"'{state.model_name}'", param="model", code="model_not_found")
    return JSONResponse(_model_card(state))
