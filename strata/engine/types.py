"""Plain data passed between the engine and its users (CLI, server, tests)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Temperatures below this sample as greedy: dividing logits by 1e-300 overflows to
# inf and inf - inf is NaN (vLLM uses the same 1e-5).
GREEDY_BELOW = 1e-5


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, an end-of-turn token, or a stop string
    LENGTH = "length"  # max_tokens reached, or the lane could not grow (see truncated)
    CANCELLED = "cancelled"


@dataclass
class SamplingParams:
    """How to pick tokens (and where: `lane`). Defaults give greedy decoding of up to 256 tokens;
    the model's recommended sampling comes from `sampling_defaults.SamplingDefaults.params`."""

    max_tokens: int = 256  # 0: read the prompt into a lane (kept there for reuse), generate nothing
    temperature: float = 0.0  # 0 (or anything below GREEDY_BELOW, or NaN) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, never emitted
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus k top alternatives
    grammar: str | None = None  # llguidance grammar text (strata/engine/grammar.py) the output must match
    min_tokens: int = 0  # before this many tokens, stop tokens are masked and stop strings ignored
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    progress: bool = False  # publish PromptProgress events while the prompt is read
    cut_points: list[int] = field(default_factory=list)  # prompt positions where a recurrent model
    # checkpoints its state (the chat's message ends, `serve/cut_points.py`)
    lane: int | None = None  # run on this lane (llama-server's id_slot), waiting while it is busy;
    # None: the scheduler picks the free lane holding the longest prefix

    @property
    def greedy(self) -> bool:
        return not self.temperature >= GREEDY_BELOW


@dataclass
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class PromptProgress:
    """How far a request's prompt has been read: for clients that show progress on long prompts."""

    total: int  # prompt tokens
    cached: int  # of those, reused from a cached conversation
    processed: int  # of those, whose K/V is in the lane (cached ones included)


@dataclass
class StreamEvent:
    """One step of one request's output.

    `text` is the newly decodable text (never a broken UTF-8 sequence; stop
    strings are held back until they can be ruled out). The last event of a
    request has `finish_reason` set. With `SamplingParams.progress`, events
    with only `progress` set come while the prompt is read.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    truncated: bool = False  # the lane could not grow: finish_reason is LENGTH
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from a cached conversation
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_string: str | None = None  # the stop string that ended generation, if any
    progress: PromptProgress | None = None  # set on prompt-progress events (no text, no tokens)
