"""Rendering a model's chat template the way Hugging Face transformers does.

Chat templates are Jinja programs written against transformers' renderer:
trim_blocks and lstrip_blocks on, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that does not HTML-escape, the `{% generation %}`
block tag. Rendering with anything
else changes whitespace or fails, and the model then sees a prompt it was not
trained on. Templates come from model files, so they run in a sandbox.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.errors import BadRequest

# Names a message's reasoning may come under; templates read `reasoning_content`
# (and gpt-oss templates `thinking`), so every name is filled from whichever is given.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, which could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (mirrors jinja's signature)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' tag marking the assistant's part of a
    training prompt (for its assistant-token masks); rendering a prompt only needs the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _make_dict
    return env


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """A compiled template, cached: compiling costs far more than rendering."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateError as exc:
        raise BadRequest(f"chat template does not compile: {exc}", param="messages") from None


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text for `messages`; BadRequest carries the template's own message on failure.

    `template_kwargs` become template variables (bos_token, eos_token,
    enable_thinking, ...), as in transformers' apply_chat_template.
    """
    compiled = compile_template(template)
    chat = [_message(m) for m in messages]
    try:
        return compiled.render(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **_plain(template_kwargs),
        )
    except jinja2.TemplateError as exc:
        raise BadRequest(str(exc), param="messages") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
        # The template did something the messages do not support (e.g. added a list to a string).
        problem = f"chat template failed on these messages: {exc}"
        raise BadRequest(problem, param="messages") from None


def _message(message: Any) -> dict[str, Any]:
    """A message as plain data, without None fields (templates test for missing keys, not None)."""
    plain = _plain(message)
    if not isinstance(plain, dict):
        got = type(message).__name__
        raise BadRequest(f"a chat message must be an object, got {got}", "messages")
    plain = {k: v for k, v in plain.items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _plain(value: Any) -> Any:
    """Only JSON-like data reaches the sandbox; other objects become "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) carry methods the sandbox need not see
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return _plain(value.item())  # numpy scalars (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"
