"""OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from strata.serve import generation as g
from strata.serve import openai_format as fmt
from strata.serve.errors import ApiError, parse_json_object, refuse_unsupported, sse_error_payload, validate_body
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


def _generation(request: Request, state: ServeState, prompt_ids: list[int], params: Any, **kw: Any) -> g.Generation:
    info = request_info(request)
    return g.Generation(
        state.ready_engine(), prompt_ids, params, metrics=state.metrics, info=info,
        started=info.get("t0", time.monotonic()), **kw,
    )


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = serve_state(request)
    data = parse_json_object(await request.body())
    refuse_unsupported(data, UNSUPPORTED_CHAT)
    req = validate_body(ChatCompletionRequest, data)
    engine = state.ready_engine()
    request_info(request)["user"] = req.user
    messages = [_template_message(m) for m in req.messages]
    prompt_text = await g.render_chat(engine, messages, req.chat_template_kwargs or {})
    prompt_ids = await g.encode(engine, prompt_text, add_special_tokens=False)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = g.fit_max_tokens(len(prompt_ids), req.wanted_max_tokens(), state.max_context(), field)
    top = req.top_logprobs or 0
    gen = _generation(request, state, prompt_ids, _params(req, max_tokens, req.wanted_logprobs()))
    splitter = ThinkSplitter(prompt_opens_thinking(prompt_text))
    await g.start(request, gen)
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name
    if req.stream:
        return g.sse(gen, _chat_stream(request, gen, splitter, cid, created, model, req.logprobs, top,
                                       req.include_usage()))
    out = await g.collect_all(request, gen, splitter)
    message: dict[str, Any] = {"role": "assistant", "content": out.content, "refusal": None}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    choice = {
        "index": 0,
        "message": message,
        "logprobs": fmt.chat_logprobs(out.logprobs, top) if req.logprobs else None,
        "finish_reason": fmt.finish_reason(out.final),
        **fmt.chat_choice_extra(out.final),
    }
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "choices": [choice], "usage": fmt.usage(gen), "system_fingerprint": None,
    })


async def _chat_stream(
    request: Request, gen: g.Generation, splitter: ThinkSplitter, cid: str, created: int, model: str,
    logprobs: bool, top: int, include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None, lps: Any = None, **extra: Any) -> str:
        body: dict[str, Any] = {
            "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish, **extra}],
        }
        if include_usage:
            body["usage"] = None
        return _data(body)

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for event in gen.events():
            pieces = splitter.feed(event.text)
            if event.finish_reason is not None:
                pieces += splitter.flush()
            lps = fmt.chat_logprobs(event.logprobs, top) if logprobs and event.logprobs else None
            for kind, text in pieces:
                key = "reasoning_content" if kind == "reasoning" else "content"
                yield chunk({key: text}, lps=lps)
                lps = None
            if lps is not None:  # logprobs of tokens whose text is still held back
                yield chunk({"content": ""}, lps=lps)
            if event.finish_reason is not None:
                yield chunk({}, fmt.finish_reason(event), **fmt.chat_choice_extra(event))
    except ApiError as err:
        yield sse_error_payload(request.url.path, err)
        return
    if include_usage:
        yield _data({
            "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None, "choices": [], "usage": fmt.usage(gen),
        })
    yield "data: [DONE]\n\n"


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
    data = parse_json_object(await request.body())
    refuse_unsupported(data, UNSUPPORTED_COMPLETIONS)
    req = validate_body(CompletionRequest, data)
    request_info(request)["user"] = req.user
    prompt_ids = await _completion_prompt(state, req)
    wanted = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    max_tokens = g.fit_max_tokens(len(prompt_ids), wanted, state.max_context(), "max_tokens")
    gen = _generation(request, state, prompt_ids, _params(req, max_tokens, req.logprobs))
    await g.start(request, gen)
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name
    top = req.logprobs or 0
    if req.stream:
        return g.sse(gen, _completion_stream(request, gen, cid, created, model, req.logprobs is not None,
                                             top, req.include_usage()))
    out = await g.collect_all(request, gen, None)
    choice = {
        "index": 0,
        "text": out.content,
        "logprobs": fmt.completion_logprobs(out.logprobs, top) if req.logprobs is not None else None,
        "finish_reason": fmt.finish_reason(out.final),
        **fmt.chat_choice_extra(out.final),
    }
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": created, "model": model,
        "choices": [choice], "usage": fmt.usage(gen), "system_fingerprint": None,
    })


async def _completion_stream(
    request: Request, gen: g.Generation, cid: str, created: int, model: str,
    logprobs: bool, top: int, include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None, lps: Any = None, **extra: Any) -> str:
        body: dict[str, Any] = {
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": lps, "finish_reason": finish, **extra}],
        }
        if include_usage:
            body["usage"] = None
        return _data(body)

    offset = 0
    try:
        async for event in gen.events():
            lps = fmt.completion_logprobs(event.logprobs, top, offset) if logprobs else None
            offset += sum(len(lp.text) for lp in event.logprobs)
            if event.text or lps and lps["tokens"]:
                yield chunk(event.text, lps=lps)
            if event.finish_reason is not None:
                yield chunk("", fmt.finish_reason(event), **fmt.chat_choice_extra(event))
    except ApiError as err:
        yield sse_error_payload(request.url.path, err)
        return
    if include_usage:
        yield _data({
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": [], "usage": fmt.usage(gen),
        })
    yield "data: [DONE]\n\n"


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
