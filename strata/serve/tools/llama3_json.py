"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is the call object.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after <|python_tag|>, several separated by ";". A call only
counts at the very start of the output; answers are plain text otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from strata.serve.tools import grammar
from strata.serve.tools.messages import TemplateInput, template_tools
from strata.serve.tools.steps import Ws, lit
from strata.serve.tools.syntax import Follow, Shape, Syntax, braced_header, object_header
from strata.serve.tools.syntax_format import SyntaxFormat
from strata.serve.tools.types import Tool

PYTHON_TAG = "<|python_tag|>"
# The template teaches "parameters"; some fine-tunes write "arguments".
_KEYS = ("parameters", "arguments")
_TRAILER = ((Ws(), lit("}")),)
_NEXT = (Follow((Ws(), lit(";")), "call"),)

SYNTAX = Syntax(
    openers={PYTHON_TAG: ("call",), "{": ("open",)},
    shapes={
        "open": Shape(object_header(_KEYS), _TRAILER, _NEXT),  # its "{" was the opener
        "call": Shape(braced_header(_KEYS), _TRAILER, _NEXT),
    },
    anywhere=False,
)


class Llama3JsonFormat(SyntaxFormat):
    name = "llama3_json"
    markers: tuple[str, ...] = ()
    syntax = SYNTAX

    def call_grammar(
        self, tools: Sequence[Tool], *, parallel: bool, special_ids: Mapping[str, int]
    ) -> str:
        """The call objects as the template writes them, joined by "; "."""
        rules = grammar.json_call_rules(tools, "parameters")
        return grammar.lark(grammar.repeated("call_body", '"; "', parallel), rules)

    def for_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]
    ) -> TemplateInput:
        return TemplateInput([dict(m) for m in messages], template_tools(tools))
