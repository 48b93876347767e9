"""OpenAI response shapes: usage, logprobs, finish reasons.

Kept apart from the handlers so the JSON layout can be checked against the
SDK's models in one place.
"""

from __future__ import annotations

import math
import time
from typing import Any

from strata.engine.types import FinishReason, PromptProgress, StreamEvent, TokenLogprob
from strata.serve.generation import Generation
from strata.serve.tools import ArgsPiece, CallStart, TextPiece, ToolCall

# OpenAI's stand-in for -inf: JSON has no infinities.
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def finish_reason(event: StreamEvent) -> str:
    return "length" if event.finish_reason == FinishReason.LENGTH else "stop"


def usage(gen: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(items: list[TokenLogprob], top: int) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion: {"content": [...]}."""
    return {
        "content": [
            {
                "token": lp.text,
                "logprob": _lp(lp.logprob),
                "bytes": _bytes(lp.text),
                "top_logprobs": [
                    {"token": text, "logprob": _lp(value), "bytes": _bytes(text)}
                    for _id, text, value in lp.top[:top]
                ],
            }
            for lp in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: list[TokenLogprob], top: int, offset: int = 0) -> dict[str, Any]:
    """The legacy completions layout: parallel lists plus text offsets."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in items:
        tokens.append(lp.text)
        values.append(_lp(lp.logprob))
        tops.append({text: _lp(value) for _id, text, value in lp.top[:top]})
        offsets.append(offset)
        offset += len(lp.text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_choice_extra(event: StreamEvent) -> dict[str, Any]:
    """Fields added to a choice beyond OpenAI's: the lane could not grow."""
    return {"truncated": True} if event.truncated else {}


def tool_call(call: ToolCall) -> dict[str, Any]:
    """A whole call in `message.tool_calls`: arguments stay JSON text, as the API has them."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_delta(piece: Any) -> dict[str, Any] | None:
    """A streamed piece as a chunk's delta, in the shape the SDK accumulates per call index."""
    if isinstance(piece, TextPiece):
        return {"content": piece.text} if piece.text else None
    if isinstance(piece, CallStart):
        return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                "function": {"name": piece.name, "arguments": ""}}]}
    if isinstance(piece, ArgsPiece):
        return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.fragment}}]}
    raise TypeError(f"not a tool stream piece: {piece!r}")


def prompt_progress(progress: PromptProgress, started: float) -> dict[str, Any]:
    """llama.cpp's prompt_progress: tokens of the prompt, reused from cache, read so far."""
    return {"total": progress.total, "cache": progress.cached, "processed": progress.processed,
            "time_ms": round((time.monotonic() - started) * 1000, 1)}
