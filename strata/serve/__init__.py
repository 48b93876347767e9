"""OpenAI- and Anthropic-compatible HTTP server over the engine (`strata serve`).

Imports are lazy so that the CLI can declare `strata serve`'s flags without
loading FastAPI and uvicorn for every other command.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_serve_arguments", "attach_engine", "build_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name in ("build_app", "attach_engine"):
        from strata.serve import app

        return getattr(app, name)
    if name in ("add_serve_arguments", "run_server"):
        from strata.serve import main

        return getattr(main, name)
    raise AttributeError(name)
