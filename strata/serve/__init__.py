"""OpenAI- and Anthropic-compatible HTTP server over the engine (`strata serve`)."""

from strata.serve.app import attach_engine, build_app
from strata.serve.main import add_serve_arguments, run_server

__all__ = ["add_serve_arguments", "attach_engine", "build_app", "run_server"]
