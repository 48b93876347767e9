"""Building blocks of call grammars in llguidance's Lark dialect.

Markers that llguidance sees as one special token of the model must be
written as that token (`<[id]>`): a quoted literal only matches text bytes,
so it would make the model spell the marker out in ordinary tokens, which it
was never trained to do. Which added tokens count as special is llguidance's
call (those flagged special, and also unflagged ones shaped like `<...>`,
such as Qwen's <tool_call>), so `special_ids_for` asks its tokenizer.
Everything else is a literal.
Arguments are inline `%json` schemas without free whitespace, so the model
writes them the way the chat template showed it (`json.dumps` separators).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from strata.serve.tools.types import Tool

MAX_PARALLEL_CALLS = 8


class SpecialTokens(Protocol):
    """The part of llguidance.LLTokenizer that says which texts are special tokens."""

    def tokenize_str(self, text: str, *, parse_special: bool = False) -> list[int]: ...

    def is_special_token(self, token: int) -> bool: ...


def special_ids_for(markers: Sequence[str], tokenizer: SpecialTokens) -> dict[str, int]:
    """The markers that `tokenizer` has as one special token, with that token's id."""
    found: dict[str, int] = {}
    for text in markers:
        ids = tokenizer.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
            found[text] = ids[0]
    return found


def literal(text: str) -> str:
    """A Lark string literal (llguidance reads it as a JSON string)."""
    return json.dumps(text)


def marker(text: str, special_ids: Mapping[str, int]) -> str:
    token = special_ids.get(text)
    return f"<[{token}]>" if token is not None else literal(text)


def arguments_schema(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's schema, forced to an object, written without free whitespace."""
    schema = dict(parameters)
    schema.setdefault("type", "object")
    schema["x-guidance"] = {
        "whitespace_flexible": False,
        "key_separator": ": ",
        "item_separator": ", ",
        "lenient": True,  # keywords llguidance does not know constrain nothing, not fail
    }
    return schema


def arguments_rule(index: int, tool: Tool) -> str:
    return f"args_{index}: %json {json.dumps(arguments_schema(tool.parameters))}"


def json_call_rules(tools: Sequence[Tool], arguments_key: str) -> list[str]:
    """`call_body`: one tool's call object, `{"name": ..., "<arguments_key>": {...}}`."""
    check_tools(tools)
    rules = ["call_body: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + f', "{arguments_key}": '
        rules.append(f"call_{i}: {literal(head)} args_{i} {literal('}')}")
        rules.append(arguments_rule(i, tool))
    return rules


def repeated(item: str, separator: str, parallel: bool) -> str:
    """`item` once, or (parallel) one to MAX_PARALLEL_CALLS times between separators."""
    if not parallel:
        return item
    return f"{item} ({separator} {item}){{0,{MAX_PARALLEL_CALLS - 1}}}"


def lark(start: str, rules: Sequence[str]) -> str:
    return "\n".join([f"start: {start}", *rules]) + "\n"


def check_tools(tools: Sequence[Tool]) -> None:
    if not tools:
        raise ValueError("a call grammar needs at least one tool")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be distinct")
