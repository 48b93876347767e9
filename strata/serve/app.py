"""The FastAPI app: routes of both APIs, auth, one log line per request, errors, metrics.

`build_app` takes an engine (or None while it loads: `attach_engine` hands it
over later), so tests can serve a fake engine and `run_server` can bind the
socket before the model is read.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import strata
from strata.engine.sampling_defaults import SamplingDefaults
from strata.serve import anthropic_api, llama_api, openai_api, slots
from strata.serve.chat_page import PAGE_PATHS, chat_page_router
from strata.serve.errors import ApiError, error_response
from strata.serve.state import ENGINE_STOPPED, ServeState, serve_state
from strata.serve.streaming import ClientDisconnected

log = logging.getLogger("strata.serve")

# Answered without an API key: load balancers probe /health; the chat page (when served) is
# public and sends the key its user types on its API calls.
OPEN_PATHS = frozenset({"/health"})
# What the OpenAI and Anthropic SDKs send from a browser.
CORS_HEADERS = ["authorization", "content-type", "x-api-key", "anthropic-version", "anthropic-beta",
                "anthropic-dangerous-direct-browser-access", "openai-organization", "openai-project",
                "x-stainless-arch", "x-stainless-lang", "x-stainless-os", "x-stainless-package-version",
                "x-stainless-retry-count", "x-stainless-runtime", "x-stainless-runtime-version",
                "x-stainless-timeout"]


class AccessMiddleware:
    """Auth, the per-request log line and request metrics, as plain ASGI.

    Plain ASGI (not BaseHTTPMiddleware) so streaming responses and the
    disconnect watcher see the real receive channel. It is also the last line
    of defence: an exception that escaped every handler becomes a logged 500
    in the API's error shape and the server keeps going.
    """

    def __init__(self, app: ASGIApp, state: ServeState, known_paths: set[str],
                 open_paths: frozenset[str]) -> None:
        self.app = app
        self.state = state
        self.known_paths = known_paths  # metric labels: unmatched paths count as "other"
        self.open_paths = open_paths

    def _authorized(self, scope: Scope) -> bool:
        """The key as UTF-8 bytes against the raw header bytes, in constant time."""
        key = self.state.api_key
        # Browsers send a CORS preflight without credentials (llama-server skips OPTIONS too);
        # it reaches no handler that reads or generates anything.
        if key is None or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            return True
        headers = {k.lower(): v for k, v in scope["headers"]}
        offered = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if offered is None and auth[:7].lower() == b"bearer ":
            offered = auth[7:].strip()
        return offered is not None and hmac.compare_digest(offered, key.encode("utf-8"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        info: dict[str, Any] = scope.setdefault("strata.info", {})
        info["t0"] = t0
        status = 0
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        metrics = self.state.metrics
        metrics.active_requests += 1
        try:
            if not self._authorized(scope):
                err = ApiError(401, "Missing or invalid API key: send 'Authorization: Bearer KEY' "
                                    "or 'x-api-key: KEY'", code="invalid_api_key",
                               kind="authentication_error")
                await error_response(scope["path"], err)(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if not started:
                err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
                await error_response(scope["path"], err)(scope, receive, send_wrapper)
        finally:
            metrics.active_requests -= 1
            elapsed = time.monotonic() - t0
            endpoint = getattr(scope.get("route"), "path", None) or scope["path"]
            if endpoint not in self.known_paths:
                endpoint = "other"
            metrics.requests.labels(endpoint=endpoint, status=str(status or 499)).inc()
            metrics.duration.labels(endpoint=endpoint).observe(elapsed)
            self._log(scope, status, elapsed, info)

    @staticmethod
    def _log(scope: Scope, status: int, elapsed: float, info: dict[str, Any]) -> None:
        extras = " ".join(
            f"{k}={info[k]}" for k in ("prompt", "completion", "cached", "finish", "truncated")
            if info.get(k) is not None
        )
        if info.get("user") is not None:  # client-chosen text: quoted, so it cannot forge a log line
            extras += f" user={info['user']!r}"
        log.info("%s %s %s %.3fs %s", scope["method"], scope["path"], status or "-", elapsed, extras)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def attach_engine(app: FastAPI, engine: Any, model_name: str | None = None,
                  sampling: SamplingDefaults | None = None) -> None:
    """Start serving `engine` (called once it has loaded); `sampling`: the defaults resolved over
    its model's recommendation (`sampling_defaults.py`), set before the first request can use them."""
    state: ServeState = app.state.strata
    state.model_name = model_name or getattr(engine, "model_name", None) or state.model_name
    if sampling is not None:
        state.sampling = sampling
    state.engine = engine


def build_app(
    engine: Any | None,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    session_dir: str | None = None,
    cors_origins: list[str] | None = None,
    keepalive_s: float = 5.0,
    chat_page: bool = True,
    sampling: SamplingDefaults | None = None,
    slots_listed: bool = True,
) -> FastAPI:
    """The HTTP app over `engine`; None means "loading" until attach_engine().

    `cors_origins` are the browser origins allowed to call the API; without
    any, no CORS header is sent, so no page on another origin can read an
    answer (and `request_body` refuses the bodies a page could send unasked).
    An empty `api_key` is refused: it would silently turn authentication off.
    `keepalive_s`: a stream the engine has said nothing on for this long (queued,
    or reading a long prompt) gets a keep-alive line. `chat_page`: the browser page at `/`
    (off with `--no-webui`). `sampling`: the defaults a request's unset sampling fields take
    (Strata's base when None). `slots_listed`: GET /slots answers (off with `--no-slots`; the
    save, restore and erase actions stay).
    """
    if api_key is not None and not api_key.strip():
        raise ValueError("an empty API key would turn authentication off; pass None for no key")
    name = model_name or (getattr(engine, "model_name", None) if engine is not None else None) or "strata"
    state = ServeState(engine=engine, model_name=name, api_key=api_key, session_dir=session_dir,
                       keepalive_s=keepalive_s, sampling=sampling or SamplingDefaults(),
                       slots_listed=slots_listed)
    app = FastAPI(title="Strata", version=strata.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.strata = state
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(slots.router)  # session files: save/restore a lane under --session-dir
    app.include_router(llama_api.router)  # llama-server's native routes: /completion, /tokenize, /props
    page_paths: frozenset[str] = PAGE_PATHS if chat_page else frozenset()
    if chat_page:
        app.include_router(chat_page_router())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"No such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        return error_response(request.url.path, ApiError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # never read: the client has left

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        st = serve_state(request)
        if st.engine is not None and not st.engine.alive:
            return JSONResponse({"status": "error", "message": ENGINE_STOPPED}, status_code=503)
        if st.engine is not None:
            return JSONResponse({"status": "ok", "model": st.model_name})
        if st.load_error is not None:
            return JSONResponse({"status": "error", "message": st.load_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(serve_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/state")
    async def live_state(request: Request) -> JSONResponse:
        st = serve_state(request)
        stats = st.engine_stats()
        return JSONResponse({
            "model": st.model_name,
            "ready": st.engine is not None,
            "uptime_s": round(time.time() - st.started, 3),
            "requests_in_flight": st.metrics.active_requests,
            "max_context": int(st.engine.config.max_context) if st.engine is not None else None,
            "stats": _jsonable(stats) if stats is not None else None,
        })

    known = {"/health", "/metrics", "/v1/state", *page_paths}
    routers = (openai_api.router, anthropic_api.router, slots.router, llama_api.router)
    known |= {r.path for router in routers for r in router.routes}
    app.add_middleware(AccessMiddleware, state=state, known_paths=known,
                       open_paths=OPEN_PATHS | page_paths)
    if cors_origins:  # outermost, so preflights are answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=CORS_HEADERS, max_age=600)
    return app
