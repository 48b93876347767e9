"""llama.cpp-style slot endpoints: list lanes, save a lane's conversation to a file, restore one, erase one.

`POST /slots/{id}?action=save|restore` with `{"filename": NAME}`, `?action=erase`, and `GET /slots`.
The engine owns the files (confined to its --session-dir) and every check on
them; this module parses the request, runs the blocking engine call off the
event loop and maps the engine's errors to OpenAI-shaped answers, so a bad
file or name is a 4xx and never reaches the pool.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from strata.errors import LaneBusy, SessionFileError, StrataError
from strata.serve.errors import ApiError, from_strata_error
from strata.serve.limits import LIMITS
from strata.serve.llama_api import generation_settings
from strata.serve.request_body import check_media_type, json_body, parse_json, path_id, read_capped
from strata.serve.state import serve_state

router = APIRouter()

ACTIONS = ("save", "restore", "erase")
BODY_FIELDS = {"filename"}


def _slot_id(raw: str, lanes: int) -> int:
    """The lane index from the path; a 400 naming id_slot for anything else."""
    lane = path_id(raw)
    if lane is None or lane >= lanes:
        raise ApiError(400, f"invalid slot id {raw[:32]!r}: slots are 0..{lanes - 1}", param="id_slot",
                       code="invalid_request")
    return lane


async def _filename(request: Request) -> str:
    data = await json_body(request)
    unknown = sorted(set(data) - BODY_FIELDS)
    if unknown:
        raise ApiError(400, f"Unrecognized request field: '{unknown[0]}'", param=unknown[0],
                       code="invalid_request")
    name = data.get("filename")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "'filename' is required: the name of a file in the --session-dir folder",
                       param="filename", code="invalid_request")
    return name


async def _no_body(request: Request) -> None:
    """An erase takes no field: no body, or an empty JSON object (what curl scripts send)."""
    raw = await read_capped(request, LIMITS.body_bytes)
    if not raw.strip():
        return
    check_media_type(request)
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object", code="invalid_json")
    if data:
        name = sorted(data)[0]
        raise ApiError(400, f"Unrecognized request field: '{name}' (an erase takes none)", param=name,
                       code="invalid_request")


def session_error(exc: Exception, filename: str) -> ApiError | None:
    """The HTTP answer for an engine error raised by a session call; None if unexpected."""
    from strata.engine.sessions import SessionFilesDisabled  # the engine is loaded by now

    if isinstance(exc, LaneBusy):
        return ApiError(409, str(exc), param=exc.param, code="slot_busy")
    if isinstance(exc, SessionFilesDisabled):
        return ApiError(501, str(exc), code="session_files_disabled")
    if isinstance(exc, SessionFileError):  # named as the client named it: no server paths
        return ApiError(400, f"session file {filename!r}: {exc.problem}", param="filename",
                        code="invalid_session_file")
    mapped = from_strata_error(exc)
    if mapped is None and isinstance(exc, StrataError):  # e.g. the engine shutting down
        mapped = ApiError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "1"})
    return mapped


async def _engine_call(fn: Any, lane: int, filename: str) -> Any:
    """Run a blocking engine session method in a thread; engine errors become API errors."""
    try:
        return await asyncio.to_thread(fn, lane, filename)
    except Exception as exc:
        mapped = session_error(exc, filename)
        if mapped is None:
            raise
        raise mapped from None


def _llama_fields(request: Any, n_ctx: int) -> dict[str, Any]:
    """llama-server's per-slot fields, so scripts written against its /slots read them unchanged.

    `request` is the engine's Request using the lane (None when idle): its id,
    sampling settings and generated tokens so far. The prompt's text is not
    shown (only counts): it is the users' conversation.
    """
    if request is None:
        return {"id_task": -1, "n_ctx": n_ctx, "speculative": False, "is_processing": False, "params": None,
                "next_token": {"has_next_token": False, "n_remain": -1, "n_decoded": 0}}
    params = request.params
    decoded = len(request.output)
    return {"id_task": int(request.id), "n_ctx": n_ctx, "speculative": False, "is_processing": True,
            "params": generation_settings(params, params.max_tokens), "n_prompt_tokens": len(request.prompt),
            "next_token": {"has_next_token": True, "n_remain": max(params.max_tokens - decoded, 0),
                           "n_decoded": decoded}}


def lane_table(engine: Any) -> list[dict[str, Any]]:
    """One row per lane: what it holds and whether a request is using it now."""
    stats = engine.stats()
    tokens = stats.get("tokens_per_session", {})
    chunks = stats.get("chunks_per_session", {})
    # stats() counts busy lanes but does not say which; the scheduler's lanes do. Read once:
    # the engine thread may end a request meanwhile.
    requests = {lane.index: lane.request for lane in engine.scheduler.lanes}
    n_ctx = int(engine.config.max_context)
    rows = []
    for index in range(int(stats["lanes_total"])):
        n = int(tokens.get(index, 0))
        request = requests.get(index)
        state = "busy" if request is not None else ("idle" if n else "empty")
        rows.append({"id": index, "state": state, "n_tokens": n, "chunks": int(chunks.get(index, 0)),
                     **_llama_fields(request, n_ctx)})
    return rows


@router.get("/slots")
async def list_slots(request: Request) -> JSONResponse:
    state = serve_state(request)
    if not state.slots_listed:  # llama-server's answer under --no-slots
        raise ApiError(501, "This server does not support slots endpoint (started with --no-slots)",
                       code="not_supported")
    engine = state.ready_engine()
    return JSONResponse(lane_table(engine))


@router.post("/slots/{id_slot}")
async def slot_action(request: Request, id_slot: str) -> JSONResponse:
    engine = serve_state(request).ready_engine()
    action = request.query_params.get("action")
    if action not in ACTIONS:
        got = "no action" if action is None else f"action {action!r}"
        raise ApiError(400, f"{got}: use ?action=save, ?action=restore or ?action=erase", param="action",
                       code="invalid_request")
    lane = _slot_id(id_slot, int(engine.stats()["lanes_total"]))
    if action == "erase":
        await _no_body(request)
        n = await _engine_call(lambda index, _: engine.erase_slot(index), lane, "")
        return JSONResponse({"id_slot": lane, "n_erased": n})
    filename = await _filename(request)
    t0 = time.perf_counter()
    if action == "save":
        result = await _engine_call(engine.save_session, lane, filename)
        ms = round((time.perf_counter() - t0) * 1000, 3)
        return JSONResponse({"id_slot": result.lane, "filename": result.filename,
                             "n_saved": result.n_tokens, "n_written": result.n_bytes,
                             "timings": {"save_ms": ms}})
    result = await _engine_call(engine.restore_session, lane, filename)
    ms = round((time.perf_counter() - t0) * 1000, 3)
    return JSONResponse({"id_slot": result.lane, "filename": result.filename,
                         "n_restored": result.n_tokens, "n_read": result.n_bytes,
                         "timings": {"restore_ms": ms}})


@router.get("/conversations")
async def list_conversations(request: Request) -> JSONResponse:
    """The parked conversations (the conversation cache), least recently used first."""
    engine = serve_state(request).ready_engine()
    return JSONResponse(await asyncio.to_thread(engine.parked))


@router.post("/conversations/{entry_id}")
async def conversation_action(request: Request, entry_id: str) -> JSONResponse:
    """`?action=save` with `{"filename"}`: a parked conversation to a session file."""
    engine = serve_state(request).ready_engine()
    if request.query_params.get("action") != "save":
        raise ApiError(400, "use ?action=save (restore a file into a lane with /slots/{id})",
                       param="action", code="invalid_request")
    entry = path_id(entry_id)
    if entry is None:
        raise ApiError(400, f"invalid conversation id {entry_id[:32]!r}", param="id", code="invalid_request")
    filename = await _filename(request)
    t0 = time.perf_counter()
    result = await _engine_call(engine.save_parked_session, entry, filename)
    ms = round((time.perf_counter() - t0) * 1000, 3)
    return JSONResponse({"id": entry, "filename": result.filename,
                         "n_saved": result.n_tokens, "n_written": result.n_bytes,
                         "timings": {"save_ms": ms}})
