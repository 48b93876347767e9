"""`strata serve`: flags, loading the engine behind a bound socket, clean shutdown.

The socket is bound first and the model loads in a background thread, so
/health answers 503 "loading" during the load instead of refusing connections.
uvicorn owns SIGINT/SIGTERM: it stops accepting, lets streams end (cancelling
them after a grace period, which frees their lanes), and then the engine is
closed here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from strata.knobs import text
from strata.serve.log_format import configure_logging

log = logging.getLogger("strata.serve")

LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
GRACEFUL_SHUTDOWN_S = 5


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the server's own flags (engine flags come from add_engine_arguments)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1); a path ending in .sock binds that unix "
                        "socket instead, as llama-server does")
    g.add_argument("--port", type=int, default=8080, help="port to bind (default: 8080)")
    g.add_argument("--api-key", default=text("STRATA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (default: $STRATA_API_KEY)")
    g.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="a browser origin allowed to call the API (repeatable, e.g. "
                        "http://localhost:3000); default: none, no CORS headers are sent")
    g.add_argument("--sse-keepalive", type=float, default=5.0, metavar="SECONDS",
                   help="send a keep-alive on a stream the engine has been silent on this long "
                        "(queued, or reading a long prompt); default: 5")
    g.add_argument("--no-slots", dest="slots", action="store_false",
                   help="GET /slots answers 501 (llama-server's flag); the slot actions stay")
    g.add_argument("--slots", dest="slots", action="store_true", default=True,
                   help="GET /slots lists the lanes (the default)")
    g.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the chat page at / (llama-server's spelling); the API is unchanged")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log verbosity")
    g.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines as text, or one JSON object a line (time, level, logger, message)")
    g.add_argument("--alias", "-a", "--served-model-name", dest="served_model_name", default=None,
                   metavar="NAME", help="the model name /v1/models and every response report "
                                        "(default: the model file's or folder's name)")
    from strata.engine.config import version_text
    from strata.engine.sampling_defaults import add_sampling_default_arguments

    g.add_argument("--version", action="version", version=version_text())
    add_sampling_default_arguments(parser.add_argument_group(
        "sampling defaults (what a request's unset fields take; left out: the model's recommendation)"))


def _model_label(model: str | None) -> str:
    """A name for /v1/models before the engine knows its own."""
    if not model:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; the exit status (1 when the model could not load)."""
    import uvicorn

    from strata.engine import Engine  # the engine package is heavy; import it only to serve
    from strata.engine.config import config_from_args
    from strata.engine.sampling_defaults import defaults_from_args
    from strata.serve.app import attach_engine, build_app
    from strata.serve.security import api_key_problem, bind_warning

    configure_logging(args.log_level, args.log_format)
    problem = api_key_problem(args.api_key)
    if problem is not None:
        log.error("strata serve: %s", problem)
        return 2
    uds = args.host if args.host.endswith(".sock") else None
    warning = None if uds else bind_warning(args.host, args.api_key)
    where = f"unix socket {uds}" if uds else f"http://{args.host}:{args.port}"
    if warning is not None:
        log.warning("%s", warning)
    config = config_from_args(args)
    alias = getattr(args, "served_model_name", None)
    app = build_app(None, api_key=args.api_key, model_name=alias or _model_label(config.model),
                    session_dir=config.session_dir, cors_origins=getattr(args, "cors_origin", None),
                    keepalive_s=args.sse_keepalive, chat_page=args.webui, slots_listed=args.slots)
    holder: dict[str, Any] = {}
    lock = threading.Lock()

    def stopping() -> None:  # the first SIGINT/SIGTERM: running requests end with a last event
        with lock:
            engine = holder.get("engine")
        if engine is not None:
            engine.cancel_all()

    server = _make_server(uvicorn.Config(
        app, host=args.host, port=args.port, uds=uds, log_level=args.log_level, access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, log_config=None,
    ), stopping)

    def load() -> None:
        try:
            engine = Engine(config)
        except Exception as exc:  # ModelLoadError and anything else: report, then stop serving
            log.error("could not load the model: %s", exc, exc_info=not _is_user_error(exc))
            app.state.strata.load_error = str(exc)
            holder["failed"] = True
            server.should_exit = True
            return
        with lock:
            if server.should_exit:  # shut down while loading: nobody will serve it
                engine.close()
                return
            holder["engine"] = engine
            sampling = defaults_from_args(args, engine.loaded.sampling)
            attach_engine(app, engine, model_name=alias, sampling=sampling)
        log.info("loaded %s; serving on %s", engine.summary(), where)
        log.info("%s", sampling.describe())

    loader = threading.Thread(target=load, name="strata-load", daemon=True)
    loader.start()
    log.info("strata serve: binding %s (model loading)", where)
    try:
        with _signals_end_quietly():
            server.run()
    finally:
        with lock:
            server.should_exit = True
            engine = holder.pop("engine", None)
        if engine is not None:
            engine.close()
            log.info("engine closed")
    if loader.is_alive():
        _exit_while_loading()
    return 1 if holder.get("failed") else 0


def _make_server(config: Any, on_exit: Any) -> Any:
    """uvicorn's server, telling the engine when a signal asks it to stop (`on_exit`, once):
    without that, a stream longer than the graceful timeout is cut off with no last event and
    uvicorn logs the cancelled task's traceback. (uvicorn is imported only to serve.)"""
    import uvicorn

    class StoppingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                on_exit()
            super().handle_exit(sig, frame)

    return StoppingServer(config)


def _exit_while_loading() -> None:
    """Stopped before the model finished loading. The loading thread is inside native code that
    cannot be interrupted, and an interpreter shutting down around it aborts the process
    ("terminate called without an active exception"); leave at once instead, in one line."""
    log.info("stopped while the model was loading; exiting")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


@contextlib.contextmanager
def _signals_end_quietly() -> Iterator[None]:
    """After its graceful shutdown uvicorn re-raises the signal it caught; by default SIGTERM
    would then kill the process before the engine is closed. Handlers that do nothing turn
    that re-raise into a normal return (uvicorn installs its own while it runs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _is_user_error(exc: Exception) -> bool:
    from strata.errors import StrataError

    return isinstance(exc, StrataError)


def main(argv: list[str] | None = None) -> int:
    """`python -m strata.serve`: the same flags as `strata serve`."""
    from strata.engine.config import EngineArgumentParser, add_engine_arguments

    parser = EngineArgumentParser(prog="strata serve", description="OpenAI- and Anthropic-compatible server")
    add_engine_arguments(parser)
    add_serve_arguments(parser)
    return run_server(parser.parse_args(argv))
