"""llama-server's native routes: /completion, /tokenize, /detokenize, /apply-template, /props, /version.

So the scripts and tools written for llama.cpp's server work unchanged: the
same paths, body fields and answer fields (llama.cpp `tools/server/README.md`).
Generation goes through the same `generation` module as the OpenAI routes,
so limits, refusals, disconnects and metrics behave alike; this module only
reads llama.cpp's fields and writes its shapes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

import strata
from strata.engine.sampling_defaults import SamplingDefaults
from strata.engine.types import SamplingParams, StreamEvent
from strata.serve import generation as g
from strata.serve import llama_format as fmt
from strata.serve.errors import ApiError
from strata.serve.openai_api import chat_prompt
from strata.serve.request_body import read_body
from strata.serve.samplers import STRATA_ORDER, apply_samplers
from strata.serve.schemas_llama import (
    IGNORED_NATIVE,
    UNSUPPORTED_NATIVE,
    DetokenizeRequest,
    NativeCompletionRequest,
    TokenizeRequest,
)
from strata.serve.schemas_openai import IGNORED_OPENAI, UNSUPPORTED_CHAT, ChatCompletionRequest
from strata.serve.state import ServeState, serve_state

router = APIRouter()

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: llama.cpp's clients read only `data:` lines
ANY_SLOT = -1  # the engine chooses the lane (the one holding the longest matching prefix)
BUILD_INFO = f"strata {strata.__version__}"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def check_ids(engine: Any, ids: list[int], field: str) -> list[int]:
    """Token ids the model has; a 400 naming `field` for the first that is not."""
    vocab = getattr(g.tokenizer_of(engine), "vocab_size", None)
    for i, t in enumerate(ids):
        if t < 0 or (isinstance(vocab, int) and t >= vocab):
            raise ApiError(400, f"token id {t} (item {i}) is outside the vocabulary", param=field,
                           code="invalid_request")
    return ids


async def _prompt_ids(engine: Any, prompt: str | list[int | str]) -> list[int]:
    """llama.cpp's prompt forms: text (BOS added as the model asks), ids, or both mixed.

    In a mixed list only a string in first place gets the model's BOS, as
    llama-server tokenizes it; ids are taken as they are.
    """
    if isinstance(prompt, str):
        return await g.encode(engine, prompt, add_special_tokens=True)
    ids: list[int] = []
    for i, piece in enumerate(prompt):
        if isinstance(piece, int):
            ids += check_ids(engine, [piece], "prompt")
        else:
            ids += await g.encode(engine, piece, add_special_tokens=i == 0)
    return ids


def _max_tokens(prompt_len: int, n_predict: int, max_context: int) -> int:
    """n_predict within the context: -1 and counts past the end both stop when it is full."""
    if prompt_len >= max_context:
        raise ApiError(400, f"the prompt is {prompt_len} tokens but --max-context is {max_context}: "
                            "nothing is left to generate", param="prompt", code="context_length_exceeded")
    room = max_context - prompt_len
    return room if n_predict < 0 else min(n_predict, room)


def _lane(engine: Any, id_slot: int) -> int | None:
    """The lane `id_slot` pins the request to (None: any); a 400 naming id_slot past the last."""
    if id_slot == ANY_SLOT:
        return None
    lanes = int(engine.stats()["lanes_total"])
    if id_slot >= lanes:
        raise ApiError(400, f"id_slot {id_slot}: this server has slots 0..{lanes - 1} (-1: any)",
                       param="id_slot", code="invalid_request")
    return id_slot


def _params(defaults: SamplingDefaults, req: NativeCompletionRequest, max_tokens: int,
            lane: int | None) -> SamplingParams:
    """The request's fields over the server's defaults, then its `samplers` chain (samplers.py)."""
    temperature = None if req.temperature is None else max(req.temperature, 0.0)
    params = defaults.params(
        max_tokens=max_tokens, temperature=temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repeat_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, seed=None if req.seed in (None, -1) else req.seed,
        stop=req.stop, logprobs=req.n_probs or None, ignore_eos=req.ignore_eos, lane=lane,
    )
    return apply_samplers(params, req.samplers)


def generation_settings(params: SamplingParams, n_predict: int, stream: bool = False) -> dict[str, Any]:
    """The sampling a request runs with, named as llama-server names it (`samplers`: the order
    Strata applies, which a client may send back as it is)."""
    return {
        "n_predict": n_predict, "temperature": params.temperature, "top_k": params.top_k,
        "top_p": params.top_p, "min_p": params.min_p, "repeat_penalty": params.repetition_penalty,
        "repeat_last_n": -1, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty, "seed": -1 if params.seed is None else params.seed,
        "stop": list(params.stop), "ignore_eos": params.ignore_eos, "n_probs": params.logprobs or 0,
        "stream": stream, "cache_prompt": True, "samplers": list(STRATA_ORDER),
    }


class _Answer:
    """The fields of one /completion answer, streamed or whole."""

    def __init__(self, state: ServeState, gen: g.Generation, req: NativeCompletionRequest, prompt: str) -> None:
        self.state = state
        self.gen = gen
        self.req = req
        self.prompt = prompt

    def _slot(self) -> int:
        """The lane that ran the request, once the engine has admitted it."""
        lane = self.gen.lane
        return ANY_SLOT if lane is None else lane

    def partial(self, text: str, ids: list[int], lps: list[Any]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "index": 0, "content": text, "tokens": list(ids) if self.req.return_tokens else [],
            "stop": False, "id_slot": self._slot(), "tokens_predicted": self.gen.completion_tokens,
            "tokens_evaluated": self.gen.prompt_tokens,
        }
        if self.req.n_probs:
            body["completion_probabilities"] = fmt.completion_probabilities(lps, self.req.n_probs)
        return body

    def final(self, text: str, ids: list[int], lps: list[Any] | None) -> dict[str, Any]:
        gen, final = self.gen, self.gen.final
        assert final is not None
        body: dict[str, Any] = {
            "index": 0, "content": text, "tokens": list(ids) if self.req.return_tokens else [],
            "id_slot": self._slot(), "stop": True, "model": self.state.model_name,
            "tokens_predicted": gen.completion_tokens, "tokens_evaluated": gen.prompt_tokens,
            "generation_settings": generation_settings(gen.params, self.req.n_predict, self.req.stream),
            "prompt": self.prompt, "has_new_line": "\n" in text, "truncated": final.truncated,
            "stop_type": fmt.stop_type(final), "stopping_word": final.stop_string or "",
            "tokens_cached": gen.prompt_tokens + gen.completion_tokens, "timings": fmt.timings(gen),
        }
        if lps is not None and self.req.n_probs:
            body["completion_probabilities"] = fmt.completion_probabilities(lps, self.req.n_probs)
        return body

    def each(self, event: StreamEvent) -> Iterator[str]:
        """A stream's lines for one event: its text, then on the last one the closing answer."""
        if event.progress is not None:
            return
        if event.text or (self.req.n_probs and event.logprobs) or (self.req.return_tokens and event.token_ids):
            yield _data(self.partial(event.text, event.token_ids, event.logprobs))
        if event.finish_reason is not None:
            yield _data(self.final("", [], None))  # as llama-server: text and tokens came before


@router.post("/completion")
async def completion(request: Request) -> Response:
    """llama-server's native completion: whole, or SSE `data:` lines ending with `"stop": true`.
    `n_predict: 0` reads the prompt into a lane and answers with no text (llama.cpp's way to warm
    the cache); `id_slot` runs it on that lane."""
    state = serve_state(request)
    req = await read_body(request, NativeCompletionRequest, UNSUPPORTED_NATIVE, IGNORED_NATIVE)
    engine = state.ready_engine()
    lane = _lane(engine, req.id_slot)
    prompt_ids = await _prompt_ids(engine, req.prompt)
    params = _params(state.sampling, req, _max_tokens(len(prompt_ids), req.n_predict, state.max_context()), lane)
    prompt_text = await run_in_threadpool(g.tokenizer_of(engine).decode, prompt_ids, skip_special_tokens=False)
    gen = g.Generation.for_request(request, state, prompt_ids, params)
    await g.start(request, gen, stream=req.stream)
    answer = _Answer(state, gen, req, prompt_text)
    if req.stream:
        return g.sse(gen, g.event_stream(request, gen, [], answer.each, lambda: [], beat=KEEPALIVE,
                                         every=state.keepalive_s))
    out = await g.collect_all(request, gen, None)
    return JSONResponse(answer.final(out.content, gen.generated_ids, out.logprobs))


def _piece(tokenizer: Any, token_id: int) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (llama-server's rule)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = serve_state(request)
    req = await read_body(request, TokenizeRequest, {})
    tokenizer = g.tokenizer_of(state.ready_engine())
    ids = await run_in_threadpool(tokenizer.encode, req.content, add_special_tokens=req.add_special)
    if not req.with_pieces:
        return JSONResponse({"tokens": ids})
    return JSONResponse({"tokens": [{"id": t, "piece": _piece(tokenizer, t)} for t in ids]})


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = serve_state(request)
    req = await read_body(request, DetokenizeRequest, {})
    engine = state.ready_engine()
    ids = check_ids(engine, req.tokens, "tokens")
    text = await run_in_threadpool(g.tokenizer_of(engine).decode, ids, skip_special_tokens=False)
    return JSONResponse({"content": text})


def _model_path(engine: Any) -> str:
    """The model file or folder served; the embedded default's file when none was named."""
    if engine.config.model is not None:
        return str(engine.config.model)
    from strata.default_model import default_model_path  # only where no --model was given
    from strata.errors import ModelLoadError

    try:
        return str(default_model_path())
    except ModelLoadError:
        return ""


@router.post("/apply-template")
async def apply_template(request: Request) -> JSONResponse:
    """llama-server's `{messages, ...}` -> `{prompt}`: the chat request's prompt as the model
    would read it (template, tools, generation prompt), so a client can edit it and send it to
    /completion. The body is a chat completion's, checked the same way."""
    state = serve_state(request)
    req = await read_body(request, ChatCompletionRequest, UNSUPPORTED_CHAT, IGNORED_OPENAI)
    _, _, prompt = await chat_prompt(state.ready_engine(), req)
    return JSONResponse({"prompt": prompt})


@router.get("/props")
async def props(request: Request) -> JSONResponse:
    """What llama-server's /props says, as far as Strata has the facts."""
    state = serve_state(request)
    engine = state.ready_engine()
    n_ctx = state.max_context()
    defaults = generation_settings(state.sampling.params(max_tokens=n_ctx), -1)
    return JSONResponse({
        "default_generation_settings": {"n_ctx": n_ctx, "params": defaults, "is_processing": False},
        "total_slots": int(engine.stats()["lanes_total"]),
        "model_alias": state.model_name,
        "model_path": _model_path(engine),
        "chat_template": getattr(g.tokenizer_of(engine), "chat_template", None) or "",
        "modalities": {"vision": False, "audio": False},
        "build_info": BUILD_INFO,
    })


@router.get("/version")
async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": strata.__version__, "build_info": BUILD_INFO})
