"""Tools and tool turns in the shape chat templates expect (transformers' conventions).

Templates `tojson` a call's arguments, so they get the parsed object (as
vLLM passes them); arguments that are not valid JSON stay the string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from strata.serve.tools.types import Tool, ToolCall


@dataclass(frozen=True)
class TemplateInput:
    """What to hand the chat template: its messages and its `tools` (None: leave unset)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """`[{"type": "function", "function": {"name", "description", "parameters"}}]`."""
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.parameters
        out.append({"type": "function", "function": function})
    return out


def template_arguments(arguments: str) -> Any:
    """The arguments as the object they spell, or the text itself when they spell none."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def assistant_with_calls(content: str | None, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """An assistant turn that made `calls`; no content becomes "" (templates add strings)."""
    return {
        "role": "assistant",
        "content": content or "",
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": template_arguments(call.arguments)},
            }
            for call in calls
        ],
    }


def tool_result(call_id: str, name: str, content: str) -> dict[str, Any]:
    """What call `call_id` (of tool `name`) returned."""
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
