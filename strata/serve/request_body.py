"""Reading a POST body: media type, size, JSON, then every value checked against the limits.

Every route that takes a body goes through `json_body`, so a limit holds
everywhere or nowhere. The checks run before any schema, tokenizer, file
system or engine sees the data:

- the media type must be JSON: a browser can send `text/plain`, form data or
  no type at all across origins without a preflight, and none of those may
  drive the server (415);
- the body is read up to `Limits.body_bytes` and no further (413);
- integer literals longer than `integer_digits` never become ints (Python
  refuses past 4,300 digits with a ValueError), `NaN`/`Infinity` and numbers
  that overflow to infinity are refused;
- nesting deeper than `depth` is refused, including the depth at which the
  JSON parser itself would raise RecursionError;
- strings holding lone UTF-16 surrogates (`"\\ud800"` is valid JSON but no
  valid text) are refused, keys included, as are over-long strings, arrays
  and objects.

Each refusal is an ApiError naming the field (`messages[0].content`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from strata.serve.errors import ApiError, refuse_unsupported, validate_body
from strata.serve.limits import LIMITS, Limits

log = logging.getLogger("strata.serve")

_Path = tuple[Any, ...] | None  # a linked path (parent, key): built into text only on an error
_WS = re.compile(r"[ \t\n\r]*")
M = TypeVar("M", bound=BaseModel)


class _LongInteger:
    """An integer literal too long to convert; reported with its field by the walk."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


class _Constant:
    """NaN, Infinity or -Infinity: accepted by Python's parser, not by JSON."""

    def __init__(self, name: str) -> None:
        self.name = name


def field_name(path: _Path) -> str:
    """`messages[0].content` from a linked path."""
    parts: list[Any] = []
    while path is not None:
        path, key = path
        parts.append(key)
    out = ""
    for key in reversed(parts):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def _top(path: _Path) -> _Path:
    """The top-level field of a linked path."""
    while path is not None and path[0] is not None:
        path = path[0]
    return path


def _too(status: int, message: str, path: _Path, code: str) -> ApiError:
    field = field_name(path) or None
    where = f"'{field}'" if field else "the request body"
    return ApiError(status, message.format(where=where), param=field, code=code)


def is_json_media_type(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def check_media_type(request: Request) -> None:
    if not is_json_media_type(request.headers.get("content-type")):
        got = request.headers.get("content-type")
        raise ApiError(415, f"Content-Type must be application/json (got {got[:80]!r})" if got
                       else "Content-Type must be application/json (none was sent)",
                       code="unsupported_media_type")


async def read_capped(request: Request, limit: int) -> bytes:
    """The body, refusing it (413) as soon as it is known to be over `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and len(declared) <= 20:
        if int(declared) > limit:
            raise ApiError(413, f"The request body is {declared} bytes; the limit is {limit}",
                           code="request_too_large")
    parts: list[bytes] = []
    size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise ApiError(413, f"The request body is over the limit of {limit} bytes",
                           code="request_too_large")
        parts.append(piece)
    return b"".join(parts)


def _parse_int(limits: Limits) -> Any:
    def parse(text: str) -> int | _LongInteger:
        digits = len(text) - (text[0] == "-")
        return _LongInteger(digits) if digits > limits.integer_digits else int(text)
    return parse


def _deep_field(text: str) -> str | None:
    """The top-level field whose value nests too deep for the parser, if the body is an object."""
    decoder = json.JSONDecoder()

    def skip(i: int) -> int:
        match = _WS.match(text, i)
        return match.end() if match else i

    i = skip(0)
    if not text.startswith("{", i):
        return None
    i += 1
    try:
        while True:
            key, i = decoder.raw_decode(text, skip(i))
            i = skip(i)
            if not text.startswith(":", i):
                return None
            try:
                _, i = decoder.raw_decode(text, skip(i + 1))
            except RecursionError:
                return str(key)
            i = skip(i)
            if not text.startswith(",", i):
                return None
            i += 1
    except (ValueError, RecursionError):
        return None


def parse_json(body: bytes, limits: Limits = LIMITS) -> Any:
    """JSON text to Python values, long integers and non-standard constants kept as markers."""
    if not body.strip():
        raise ApiError(400, "The request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"The request body is not valid UTF-8: {exc}", code="invalid_json") from None
    try:
        return json.loads(text, parse_int=_parse_int(limits), parse_constant=_Constant)
    except RecursionError:
        key = _deep_field(text)
        path: _Path = None if key is None else (None, key)
        raise _too(400, "{where} is nested more than " + f"{limits.depth} levels deep", path,
                   "too_deep") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}", code="invalid_json") from None


def _check_string(s: str, path: _Path, limits: Limits, what: str = "") -> None:
    if len(s) > limits.string_chars:
        raise _too(400, "{where} " + f"{what}is {len(s)} characters; the limit is {limits.string_chars}",
                   path, "string_too_long")
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise _too(400, "{where} " + f"{what}holds a lone UTF-16 surrogate, which is not text",
                       path, "invalid_text") from None


def check_values(data: Any, limits: Limits = LIMITS) -> None:
    """Walk the parsed body (without recursion) and refuse the first value over a limit."""
    stack: list[tuple[Any, _Path, int]] = [(data, None, 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_string(value, path, limits)
        elif isinstance(value, (dict, list)):
            if depth > limits.depth:  # named by its top-level field: the full path is the problem
                raise _too(400, "{where} is nested more than " + f"{limits.depth} levels deep",
                           _top(path), "too_deep")
            if isinstance(value, dict):
                if len(value) > limits.object_keys:
                    raise _too(400, "{where} " + f"has {len(value)} keys; the limit is {limits.object_keys}",
                               path, "too_many_keys")
                for key, item in value.items():
                    _check_string(key, path, limits, "has a key that ")
                    stack.append((item, (path, key), depth + 1))
            else:
                if len(value) > limits.array_items:
                    raise _too(400, "{where} " + f"has {len(value)} items; the limit is {limits.array_items}",
                               path, "too_many_items")
                stack.extend((item, (path, i), depth + 1) for i, item in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise _too(400, "{where} is a number too large to represent", path, "invalid_number")
        elif isinstance(value, _LongInteger):
            raise _too(400, "{where} " + f"is an integer of {value.digits} digits; the limit is "
                       f"{limits.integer_digits}", path, "invalid_number")
        elif isinstance(value, _Constant):
            raise _too(400, "{where} " + f"is {value.name}, which is not a JSON number", path,
                       "invalid_number")


async def json_body(request: Request, limits: Limits = LIMITS) -> dict[str, Any]:
    """The request's body as a checked JSON object, or the ApiError that refuses it."""
    check_media_type(request)
    data = parse_json(await read_capped(request, limits.body_bytes), limits)
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object", code="invalid_json")
    check_values(data, limits)
    return data


def path_id(raw: str, limits: Limits = LIMITS) -> int | None:
    """A non-negative id from a URL path, or None; never converts more than a few digits."""
    if raw.isascii() and raw.isdigit() and len(raw) <= limits.path_id_digits:
        return int(raw)
    return None


async def read_body(
    request: Request, model: type[M], unsupported: dict[str, list[Any]],
    ignored: frozenset[str] = frozenset(),
) -> M:
    """A POST body as `model`: checked JSON, known but unbuilt fields refused, then validated.

    `ignored` fields cannot change the answer (bookkeeping, scheduling hints):
    they are dropped with one debug line, so clients that always send them work.
    """
    data = await json_body(request)
    dropped = sorted(name for name in ignored if name in data)
    if dropped:
        for name in dropped:
            del data[name]
        log.debug("%s: ignoring %s", request.url.path, ", ".join(dropped))
    refuse_unsupported(data, unsupported)
    return validate_body(model, data)
