"""The size limits every API route enforces, in one place.

One request must never be able to take the server's memory or its event
loop: these bound what a body may hold before any handler, tokenizer or
engine sees it. `docs/SERVER.md` lists them with what exceeding each returns
(413 for the body size, 400 naming the field for the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.serve.errors import FieldError


@dataclass(frozen=True)
class Limits:
    body_bytes: int = 16 << 20  # a POST body; more is a 413
    depth: int = 64  # nesting of JSON arrays and objects (the body itself is level 1)
    string_chars: int = 4 << 20  # any one string value (a prompt, a message, a key)
    array_items: int = 1 << 17  # any one array (enough for a 128k-token prompt of ids)
    object_keys: int = 1024  # any one object
    integer_digits: int = 40  # an integer literal, sign excluded (2**64 has 20 digits)
    messages: int = 4096  # chat / messages turns
    stop_strings: int = 16  # stop / stop_sequences entries
    stop_chars: int = 1024  # characters of one stop string
    path_id_digits: int = 9  # a numeric id in a URL path (/slots/{id}, /conversations/{id})
    tools: int = 128  # tool definitions of one request
    tool_name: int = 64  # characters of a tool's name
    logit_bias: int = 1024  # logit_bias entries


LIMITS = Limits()  # the server's limits; a frozen value, shared read-only


def check_stop_strings(field: str, stops: list[str]) -> None:
    """Stop strings: not empty, and within the count and length limits (the engine holds them)."""
    if len(stops) > LIMITS.stop_strings:
        raise FieldError(field, f"{field} has {len(stops)} strings; the limit is {LIMITS.stop_strings}")
    for s in stops:
        if not s:
            raise FieldError(field, "stop strings must not be empty")
        if len(s) > LIMITS.stop_chars:
            raise FieldError(field, f"a stop string of {len(s)} characters is over the limit of "
                                    f"{LIMITS.stop_chars}")
