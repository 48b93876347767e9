"""Tools and structured output in a chat request, whichever API it came in.

The prompt side: the tools reach the model through its own chat template when
the template knows tools (its family's call format is then parsed back), and
through a system instruction in the generic format when it does not. A forced
call (`required`, a named tool, Anthropic's `any`/`tool`) and a requested
answer schema become a grammar the sampler enforces, so the JSON is valid
against its schema even from a tiny model. The answer side: the text is split
into content and calls by the same format, whole or as a stream.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool

from strata.engine.grammar import json_schema_grammar, lark_grammar
from strata.errors import StrataError
from strata.serve.generation import as_api_error, tokenizer_of
from strata.serve.tools import (
    Parsed,
    Tool,
    ToolFormat,
    ToolStream,
    format_for_template,
    special_ids_for,
)

Choice = Literal["none", "auto", "required"]


def new_id(prefix: str) -> Callable[[], str]:
    """Call ids in an API's style: call_... (OpenAI) or toolu_... (Anthropic)."""
    return lambda: f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolRequest:
    """The tools a request offers and how the model may use them."""

    tools: list[Tool]
    choice: Choice = "auto"
    named: str | None = None  # the one tool that must be called
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice == "required" or self.named is not None

    @property
    def offered(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def callable_tools(self) -> list[Tool]:
        return [t for t in self.tools if self.named is None or t.name == self.named]


@dataclass(frozen=True)
class ChatSetup:
    """What the prompt builder decided: messages and tools for the template, the grammar, the parser."""

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None = None
    grammar: str | None = None
    format: ToolFormat | None = None  # set when the answer may hold tool calls
    names: frozenset[str] = frozenset()
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def parse(self, text: str, ids: Callable[[], str]) -> Parsed:
        if self.format is None:
            return Parsed(text, [])
        return self.format.parse(text, self.names, ids)

    def stream(self, ids: Callable[[], str]) -> ToolStream | None:
        return None if self.format is None else self.format.stream(self.names, ids)


def chat_template_of(tokenizer: Any) -> str | None:
    """The template that will render a request with tools (a `tool_use` variant if there is one)."""
    templates = getattr(tokenizer, "chat_templates", None) or {}
    return templates.get("tool_use") or getattr(tokenizer, "chat_template", None)


def prepare_chat(
    engine: Any,
    messages: list[dict[str, Any]],
    tools: ToolRequest | None,
    answer_schema: dict[str, Any] | bool | None,
    schema_param: str,
    *,
    constrain: bool = True,
) -> ChatSetup:
    """Messages, template tools and grammar for one request (blocking: run it off the event loop).

    A conversation with earlier calls or results goes through the format even
    when this request offers no tools, so the template sees them in its shape.
    A forced call and an answer schema never come together (the request
    schemas refuse that). `constrain=False` (token counting) builds no grammar.
    """
    offered = tools.tools if tools is not None and tools.offered else []
    forced = bool(offered) and tools is not None and tools.forced
    grammar = None
    if constrain and answer_schema is not None:
        grammar = _checked(engine, json_schema_grammar(answer_schema, param=schema_param), schema_param)
    if not offered and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return ChatSetup(messages, grammar=grammar)
    fmt = format_for_template(chat_template_of(tokenizer_of(engine)))
    rendered = fmt.for_template(messages, offered)
    if constrain and forced:
        assert tools is not None
        special = special_ids_for(fmt.markers, engine.grammars.lltokenizer("tools"))
        call = fmt.call_grammar(tools.callable_tools(), parallel=tools.parallel, special_ids=special)
        grammar = _checked(engine, lark_grammar(call), "tools")
    return ChatSetup(
        rendered.messages, rendered.tools, grammar, fmt if offered else None,
        frozenset(t.name for t in offered),
        # thinking would have to take the call's shape: the call comes first
        {"enable_thinking": False} if forced else {},
    )


def _checked(engine: Any, grammar: str, param: str) -> str:
    engine.grammars.check(grammar, param)
    return grammar


async def chat_setup(
    engine: Any, messages: list[dict[str, Any]], tools: ToolRequest | None,
    answer_schema: dict[str, Any] | bool | None, schema_param: str, *, constrain: bool = True,
) -> ChatSetup:
    """`prepare_chat` off the event loop; a schema or grammar the compiler refuses is a 400."""
    try:
        return await run_in_threadpool(prepare_chat, engine, messages, tools, answer_schema, schema_param,
                                       constrain=constrain)
    except StrataError as exc:
        raise as_api_error(exc) from None
