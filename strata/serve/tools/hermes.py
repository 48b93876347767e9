"""Hermes-style calls (Qwen2.5, Qwen3, Hermes): JSON objects inside <tool_call> tags.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls follow one another, one tag pair each; text before them is content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from strata.serve.tools import grammar
from strata.serve.tools.messages import TemplateInput, template_tools
from strata.serve.tools.steps import Ws, lit
from strata.serve.tools.syntax import Shape, Syntax, braced_header
from strata.serve.tools.syntax_format import SyntaxFormat
from strata.serve.tools.types import Tool

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

SYNTAX = Syntax(
    openers={OPEN: ("call",)},
    shapes={
        "call": Shape(
            header=braced_header(("arguments",)),
            trailer=((Ws(), lit("}")), (Ws(), lit(CLOSE))),
        )
    },
    anywhere=True,
)


def hermes_grammar(
    tools: Sequence[Tool], *, parallel: bool, special_ids: Mapping[str, int]
) -> str:
    """Exactly the calls, each as the template writes one, separated by a newline."""
    open_tag, close_tag = grammar.marker(OPEN, special_ids), grammar.marker(CLOSE, special_ids)
    call = f'{open_tag} "\\n" call_body "\\n" {close_tag}'
    rules = [f"call: {call}", *grammar.json_call_rules(tools, "arguments")]
    return grammar.lark(grammar.repeated("call", '"\\n"', parallel), rules)


class HermesFormat(SyntaxFormat):
    name = "hermes"
    markers = (OPEN, CLOSE)
    syntax = SYNTAX

    def call_grammar(
        self, tools: Sequence[Tool], *, parallel: bool, special_ids: Mapping[str, int]
    ) -> str:
        return hermes_grammar(tools, parallel=parallel, special_ids=special_ids)

    def for_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]
    ) -> TemplateInput:
        return TemplateInput([dict(m) for m in messages], template_tools(tools))


def call_text(name: str, arguments: Any) -> str:
    """One call written out as a Hermes model writes it (arguments: object or JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    quoted = json.dumps(name, ensure_ascii=False)
    return f'{OPEN}\n{{"name": {quoted}, "arguments": {args}}}\n{CLOSE}'
