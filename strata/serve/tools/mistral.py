"""Mistral tool calls, in both of the forms its tokenizers have used.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...

Parsing reads either form (also the second without [ARGS], which decoding
may drop as a special token); the grammar writes the form the template uses.
Mistral templates insist on call ids of 9 letters and digits, so calls and
results reach the template under ids derived from the client's.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from strata.serve.tools import grammar
from strata.serve.tools.messages import TemplateInput, template_tools
from strata.serve.tools.steps import BareName, Opt, Ws, lit
from strata.serve.tools.syntax import Follow, Shape, Syntax, braced_header
from strata.serve.tools.syntax_format import SyntaxFormat
from strata.serve.tools.types import Tool

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ITEM = braced_header(("arguments",))
_ITEM_TRAILER = ((Ws(), lit("}")),)
_ITEM_FOLLOW = (Follow((Ws(), lit(",")), "item"), Follow((Ws(), lit("]")), None))
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")

SYNTAX = Syntax(
    openers={TOOL_CALLS: ("array", "named")},
    shapes={
        "array": Shape((Ws(), lit("[")) + _ITEM, _ITEM_TRAILER, _ITEM_FOLLOW),
        "item": Shape(_ITEM, _ITEM_TRAILER, _ITEM_FOLLOW),
        "named": Shape((Ws(), BareName(), Opt(ARGS), Ws(), lit("{"))),
    },
    anywhere=True,
)


def mistral_call_id(call_id: str) -> str:
    """The id as Mistral templates accept it: kept when it already fits, else a stable digest."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:9]


def _with_mistral_ids(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if isinstance(out.get("tool_call_id"), str):
        out["tool_call_id"] = mistral_call_id(out["tool_call_id"])
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [
            {**c, "id": mistral_call_id(c["id"])} if isinstance(c.get("id"), str) else c
            for c in out["tool_calls"]
        ]
    return out


class MistralFormat(SyntaxFormat):
    """`named_calls`: the template writes `name[ARGS]{...}` (tokenizer v11 and later)."""

    name = "mistral"
    syntax = SYNTAX

    def __init__(self, named_calls: bool) -> None:
        self.named_calls = named_calls
        self.markers = (TOOL_CALLS, ARGS) if named_calls else (TOOL_CALLS,)

    def call_grammar(
        self, tools: Sequence[Tool], *, parallel: bool, special_ids: Mapping[str, int]
    ) -> str:
        opener = grammar.marker(TOOL_CALLS, special_ids)
        if not self.named_calls:
            calls = grammar.repeated("call_body", '", "', parallel)
            body = f'"[" {calls} "]"'
            rules = grammar.json_call_rules(tools, "arguments")
            return grammar.lark(f"{opener} {body}", rules)
        grammar.check_tools(tools)
        args_marker = grammar.marker(ARGS, special_ids)
        rules = ["named: " + " | ".join(f"named_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            rules.append(f"named_{i}: {opener} {grammar.literal(tool.name)} {args_marker} args_{i}")
            rules.append(grammar.arguments_rule(i, tool))
        start = f"named{{1,{grammar.MAX_PARALLEL_CALLS}}}" if parallel else "named"
        return grammar.lark(start, rules)

    def for_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]
    ) -> TemplateInput:
        return TemplateInput([_with_mistral_ids(m) for m in messages], template_tools(tools))
