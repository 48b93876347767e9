"""HTTP errors in the two API dialects.

Handlers raise `ApiError`; one exception handler renders it in the shape the
caller's SDK parses (OpenAI or Anthropic, chosen by path), so no client input
ever surfaces as a bare 500 or an HTML page.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from strata.errors import BadRequest, ContextTooLong, Overloaded

M = TypeVar("M", bound=BaseModel)

# Anthropic error types by status; OpenAI uses "type" more loosely (see openai_type).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class FieldError(ValueError):
    """Raised by a whole-body check to blame one field (pydantic would blame the body)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ApiError(Exception):
    """An error answer: status, message, the offending field and a machine code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        kind: str | None = None,
    ) -> None:
        """`kind` replaces the OpenAI dialect's `type` where llama-server's differs (a bad key)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.kind = kind


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def openai_type(status: int) -> str:
    """OpenAI reports every client-side problem as invalid_request_error."""
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(path: str, err: ApiError) -> dict[str, Any]:
    """The JSON body of `err` in the dialect that `path` belongs to."""
    if is_anthropic_path(path):
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error"), "message": err.message},
        }
    return {
        "error": {
            "message": err.message,
            "type": err.kind or openai_type(err.status),
            "param": err.param,
            "code": err.code,
        }
    }


def error_response(path: str, err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(path, err), status_code=err.status, headers=err.headers)


def sse_error_payload(path: str, err: ApiError) -> str:
    """An error sent inside an already-started event stream."""
    body = json.dumps(error_body(path, err))
    if is_anthropic_path(path):
        return f"event: error\ndata: {body}\n\n"
    return f"data: {body}\n\n"


def retry_after_header(seconds: float) -> str:
    """Retry-After takes whole seconds; round up so clients never come back early."""
    return str(max(1, math.ceil(seconds)))


def from_strata_error(exc: Exception) -> ApiError | None:
    """Map the engine's typed errors to HTTP; None for anything unexpected."""
    if isinstance(exc, Overloaded):
        return ApiError(
            503,
            str(exc) or "the server is overloaded",
            code=exc.code,
            headers={"Retry-After": retry_after_header(exc.retry_after)},
        )
    if isinstance(exc, ContextTooLong):
        return ApiError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, BadRequest):
        return ApiError(400, str(exc), param=exc.param, code="invalid_request")
    return None


def _field_path(loc: tuple[int | str, ...]) -> str:
    """`messages[0].content` from pydantic's loc, dropping union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if not part or part[0].isupper() or any(c in part for c in "[]-(),="):
            continue  # a union member tag such as 'list[TextPart]', 'TextBlock' or 'type=text'
        if part in ("str", "int", "float", "bool", "list", "dict", "none"):
            continue
        out += f".{part}" if out else part
    return out


def from_validation_error(exc: ValidationError) -> ApiError:
    """A 400 naming the most specific offending field in words a client can act on."""
    errors = exc.errors(include_url=False)
    paths = [_field_path(tuple(e["loc"])) for e in errors]
    if len(errors) > 1 and len(set(paths)) == 1:
        # Every member of a union refused the value: list what each wanted.
        wanted = "; ".join(dict.fromkeys(e["msg"] for e in errors))
        field = paths[0]
        message = f"Invalid value for '{field}': matches no accepted form ({wanted})"
        return ApiError(400, message, param=field or None, code="invalid_request")
    # The deepest path is the most specific (a union's inner error beats "not a string").
    index = max(range(len(errors)), key=lambda i: paths[i].count(".") + paths[i].count("["))
    first, field = errors[index], paths[index]
    kind = first["type"]
    blamed = first.get("ctx", {}).get("error")
    if isinstance(blamed, FieldError):
        field = f"{field}.{blamed.field}" if field else blamed.field
    if kind == "extra_forbidden":
        message = f"Unrecognized request field: '{field}'"
    elif kind == "missing":
        message = f"Missing required field: '{field}'"
    elif kind == "value_error":
        message = f"Invalid value for '{field}': {first['msg'].removeprefix('Value error, ')}"
    else:
        message = f"Invalid value for '{field}': {first['msg']}"
    return ApiError(400, message, param=field or None, code="invalid_request")


def refuse_unsupported(data: dict[str, Any], table: dict[str, list[Any]]) -> None:
    """400 for a known API field this server does not implement, unless it is neutral.

    A field whose value changes nothing (n=1, tools=[], null) is dropped so the
    request goes through; any other value is refused rather than silently ignored.
    """
    for name, neutral in table.items():
        if name not in data:
            continue
        value = data.pop(name)
        if value is None or any(type(value) is type(v) and value == v for v in neutral):
            continue
        raise ApiError(
            400,
            f"'{name}' is not supported by this server (got {json.dumps(value)[:80]})",
            param=name,
            code="unsupported_parameter",
        )


def validate_body(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
