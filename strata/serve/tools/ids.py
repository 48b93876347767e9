"""Tool call ids, made by a replaceable function so tests can make them predictable."""

from __future__ import annotations

import secrets
from collections.abc import Callable

IdFactory = Callable[[], str]


def new_call_id() -> str:
    """`call_` and 24 random hex digits, the shape OpenAI's own ids have."""
    return "call_" + secrets.token_hex(12)
