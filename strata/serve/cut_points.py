"""Where a chat's prompt may be cut: the token positions at which its messages end.

A recurrent model checkpoints its state while it reads a prompt
(`engine/checkpoints.py`); the checkpoints that pay are the ones a later
request of the same chat shares: the end of the system prompt and tools
(the root), the end of each message (the start of the next). The template
renders the chat up to each message; where that text is the prompt's own
beginning, its tokens' shared length with the prompt is a cut point. A
template that renders earlier turns differently (one that drops old
reasoning, say) still gives positions the prompt really has: only the
shared tokens count.
"""

from __future__ import annotations

from typing import Any

from strata.engine.scheduler import common_prefix

MAX_CUTS = 16  # the root and the last messages' ends: a checkpoint further back rarely pays


def message_cut_points(tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any],
                       tools: list[dict[str, Any]] | None, prompt_text: str,
                       prompt_ids: list[int]) -> list[int]:
    """Ascending positions in (0, len(prompt_ids)) where a message of `messages` ends; the prompt
    is `prompt_text` (the template's rendering of the chat) encoded."""
    ends = list(range(1, len(messages)))
    root = next((k for k, m in enumerate(messages) if m.get("role") not in ("system", "developer")), 0)
    picked = sorted({*([root] if root > 0 else []), *ends[-(MAX_CUTS - 1):]})
    cuts: set[int] = set()
    for k in picked:
        try:
            text = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=False, tools=tools,
                                                 **template_kwargs)
        except Exception:  # noqa: BLE001 - a template that cannot render a partial chat: no cut there
            continue
        if not text or not prompt_text.startswith(text):
            continue
        n = common_prefix(tokenizer.encode(text, add_special_tokens=False), prompt_ids)
        if 0 < n < len(prompt_ids):
            cuts.add(n)
    return sorted(cuts)
