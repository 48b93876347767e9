"""Tool turns folded into plain text, for chat templates that only know system/user/assistant.

Earlier calls become the Hermes call text inside the assistant's content and
tool results become `<tool_response>` blocks in a user turn, the same tags
the generic instruction teaches, so the model sees its own format again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from strata.serve.tools.hermes import call_text

RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


def plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (transformers conventions) with every tool call and result as plain text."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") == "tool":
            _add_response(out, _text(message.get("content")))
        elif message.get("role") == "assistant" and message.get("tool_calls"):
            out.append(_assistant_text(message))
        else:
            out.append(dict(message))
    return out


def with_instruction(
    messages: Sequence[Mapping[str, Any]], instruction: str
) -> list[dict[str, Any]]:
    """`instruction` before an opening system message's text, or as a new system message."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{instruction}\n\n{out[0]['content']}"
    else:
        out.insert(0, {"role": "system", "content": instruction})
    return out


def _assistant_text(message: Mapping[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function", call)
        calls.append(call_text(function.get("name", ""), function.get("arguments", {})))
    content = _text(message.get("content"))
    text = "\n".join(([content] if content else []) + calls)
    plain = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**plain, "content": text}


def _add_response(out: list[dict[str, Any]], content: str) -> None:
    block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
    if out and out[-1].get("role") == "user" and isinstance(out[-1].get("content"), str):
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
    else:
        out.append({"role": "user", "content": block})


def _text(content: Any) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
