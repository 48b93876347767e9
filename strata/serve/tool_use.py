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
from strata.serve.errors import ApiError
from strata.serve.tools import (
    Parsed,
    Tool,
    ToolCall,
    ToolFormat,
    ToolStream,
    format_for_template,
    generic_messages,
    template_tools,
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

    def callable_tools(self) -> list[Tool]:
        return [t for t in self.tools if self.named is None or t.name == self.named]


@dataclass
class ChatSetup:
    """What the prompt builder decided: messages and tools for the template, the grammar, the parser."""

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None = None
    grammar: str | None = None
    format: ToolFormat | None = None  # set when the answer may hold tool calls
    names: set[str] = field(default_factory=set)
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def parse(self, text: str) -> Parsed:
        if self.format is None:
            return Parsed(text, [])
        return self.format.parse(text, self.names)

    def stream(self, ids: Callable[[], str]) -> ToolStream | None:
        return None if self.format is None else self.format.stream(self.names, ids)


def chat_template_of(tokenizer: Any) -> str | None:
    templates = getattr(tokenizer, "chat_templates", None) or {}
    return templates.get("tool_use") or getattr(tokenizer, "chat_template", None)


def prepare_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: ToolRequest | None,
    answer_schema: dict[str, Any] | bool | None,
    schema_param: str,
) -> ChatSetup:
    """Messages, template tools and grammar for one request (pure; checked by `check_grammar`)."""
    setup = ChatSetup(messages)
    has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if tools is None and not has_history:
        if answer_schema is not None:
            setup.grammar = json_schema_grammar(answer_schema, param=schema_param)
        return setup
    fmt = format_for_template(chat_template_of(tokenizer))
    offered = tools is not None and tools.tools and tools.choice != "none"
    if fmt.name == "generic":
        setup.messages = generic_messages(messages, tools.tools if offered and tools else [])
    elif offered and tools is not None:
        setup.template_tools = template_tools(tools.tools)
    if offered and tools is not None:
        setup.format = fmt
        setup.names = {t.name for t in tools.tools}
        if tools.forced:
            setup.grammar = lark_grammar(fmt.call_grammar(
                tools.callable_tools(), parallel=tools.parallel, special=special_token_check(tokenizer)))
            # thinking would be forced into the call's shape: the call comes first
            setup.template_kwargs["enable_thinking"] = False
    if answer_schema is not None and setup.grammar is None:
        setup.grammar = json_schema_grammar(answer_schema, param=schema_param)
    return setup


def special_token_check(tokenizer: Any) -> Callable[[str], int | None]:
    """The id of `text` when it is one special token of the vocabulary (call markers often are)."""
    def check(text: str) -> int | None:
        special = getattr(tokenizer, "special_id", None)
        return special(text) if special is not None else None
    return check


async def check_grammar(engine: Any, setup: ChatSetup, param: str) -> None:
    """An invalid schema or grammar is the client's 400, found before the engine sees it."""
    if setup.grammar is None:
        return
    grammars = getattr(engine, "grammars", None)
    if grammars is None:
        raise ApiError(400, "this engine cannot constrain output to a grammar", param=param)
    await run_in_threadpool(grammars.check, setup.grammar, param)


def calls_finish(calls: list[ToolCall], finished_by_length: bool) -> bool:
    """Whether an answer ends as a tool call (a cut-off answer keeps its `length`)."""
    return bool(calls) and not finished_by_length
