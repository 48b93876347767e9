"""llama-server's response shapes: timings, stop types, completion_probabilities.

Apart from the handlers so the OpenAI routes can add the same `timings`
object to their answers, as llama-server does, and so the layout can be
checked against llama.cpp's README in one place.
"""

from __future__ import annotations

import math
import time
from typing import Any

from strata.engine.types import FinishReason, StreamEvent, TokenLogprob
from strata.serve.generation import Generation

MIN_LOGPROB = -9999.0  # JSON has no -inf; the OpenAI routes use the same stand-in


def _rate(n: int, ms: float) -> tuple[float, float]:
    """(ms per token, tokens per second); zeros where nothing was measured."""
    if n <= 0 or ms <= 0:
        return 0.0, 0.0
    return ms / n, n * 1000.0 / ms


def timings(gen: Generation) -> dict[str, Any]:
    """llama-server's `timings`: prompt time to the first token (queueing included), then decode.

    prompt_n counts the tokens read this time; cache_n those reused from a
    lane's or the conversation cache's earlier K/V.
    """
    now = time.monotonic()
    first = gen.first_token_time if gen.first_token_time is not None else now
    last = gen.last_token_time if gen.last_token_time is not None else now
    prompt_n = max(gen.prompt_tokens - gen.cached_tokens, 0)
    prompt_ms = max(first - gen.started, 0.0) * 1000.0
    predicted_n = gen.completion_tokens
    predicted_ms = max(last - first, 0.0) * 1000.0
    p_tok, p_sec = _rate(prompt_n, prompt_ms)
    d_tok, d_sec = _rate(predicted_n, predicted_ms)
    return {
        "cache_n": gen.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(p_tok, 3),
        "prompt_per_second": round(p_sec, 3),
        "predicted_n": predicted_n,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(d_tok, 3),
        "predicted_per_second": round(d_sec, 3),
    }


def stop_type(event: StreamEvent | None) -> str:
    """"eos" (an end token), "word" (a stop string), "limit" (n_predict or the context), "none"."""
    if event is None or event.finish_reason is None:
        return "none"
    if event.finish_reason == FinishReason.LENGTH:
        return "limit"
    return "word" if event.stop_string is not None else "eos"


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _entry(token_id: int, text: str, logprob: float) -> dict[str, Any]:
    return {"id": token_id, "token": text, "bytes": list(text.encode("utf-8", errors="replace")),
            "logprob": _lp(logprob)}


def completion_probabilities(items: list[TokenLogprob], n_probs: int) -> list[dict[str, Any]]:
    """One entry per generated token: the token and its `n_probs` most likely alternatives."""
    return [{**_entry(lp.token_id, lp.text, lp.logprob),
             "top_logprobs": [_entry(i, t, v) for i, t, v in lp.top[:n_probs]]}
            for lp in items]
