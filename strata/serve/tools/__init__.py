"""Tool calling per model family: parsing, streaming, call grammars and template input.

Pure text in and out; the HTTP layers turn these values into their own wire shapes.
"""

from strata.serve.tools.detect import format_for_template, template_supports_tools
from strata.serve.tools.format import ToolFormat, ToolStream
from strata.serve.tools.generic import GenericFormat, instruction
from strata.serve.tools.generic_messages import plain_messages, with_instruction
from strata.serve.tools.grammar import MAX_PARALLEL_CALLS, special_ids_for
from strata.serve.tools.hermes import HermesFormat
from strata.serve.tools.ids import IdFactory, new_call_id
from strata.serve.tools.llama3_json import Llama3JsonFormat
from strata.serve.tools.messages import (
    TemplateInput,
    assistant_with_calls,
    template_tools,
    tool_result,
)
from strata.serve.tools.mistral import MistralFormat, mistral_call_id
from strata.serve.tools.pieces import merge_pieces
from strata.serve.tools.types import ArgsPiece, CallStart, Parsed, Piece, TextPiece, Tool, ToolCall

__all__ = [
    "MAX_PARALLEL_CALLS",
    "ArgsPiece",
    "CallStart",
    "GenericFormat",
    "HermesFormat",
    "IdFactory",
    "Llama3JsonFormat",
    "MistralFormat",
    "Parsed",
    "Piece",
    "TemplateInput",
    "TextPiece",
    "Tool",
    "ToolCall",
    "ToolFormat",
    "ToolStream",
    "assistant_with_calls",
    "format_for_template",
    "instruction",
    "merge_pieces",
    "mistral_call_id",
    "new_call_id",
    "plain_messages",
    "special_ids_for",
    "template_supports_tools",
    "template_tools",
    "tool_result",
    "with_instruction",
]
