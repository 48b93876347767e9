"""Tool calling for models whose chat template knows nothing of tools.

The tools are described in a system instruction that asks for calls in the
Hermes tag format, which is then how calls are parsed, streamed and
constrained; earlier tool turns are folded into plain text (generic_messages).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from strata.serve.tools.generic_messages import plain_messages, with_instruction
from strata.serve.tools.hermes import CLOSE, OPEN, HermesFormat
from strata.serve.tools.messages import TemplateInput, template_tools
from strata.serve.tools.types import Tool


def instruction(tools: Sequence[Tool]) -> str:
    """The system text that tells the model which tools it has and how to call them."""
    described = "\n".join(json.dumps(t, ensure_ascii=False) for t in template_tools(tools))
    return (
        "You can call tools (functions) to help answer. Each tool is described by a JSON "
        "object: its name, what it does, and a JSON schema of its parameters.\n"
        f"<tools>\n{described}\n</tools>\n\n"
        f"To call a tool, write a {OPEN}{CLOSE} block holding one JSON object with the "
        "tool's name and its arguments, exactly like this:\n"
        f'{OPEN}\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}\n'
        "Write one block per call. Call only the tools listed above; "
        "when no tool is needed, answer in plain text."
    )


class GenericFormat(HermesFormat):
    name = "generic"

    def for_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]
    ) -> TemplateInput:
        """Folded messages with the instruction; the template gets no `tools`."""
        folded = plain_messages(messages)
        if tools:
            folded = with_instruction(folded, instruction(tools))
        return TemplateInput(folded, None)
