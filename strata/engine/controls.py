"""Per-request controls on a step's logits before sampling: logit_bias, min_tokens, grammar masks.

Grammar masks come from llguidance on the host, one bit per token. A step's
masks are started on a worker thread before its forward runs
(`MaskWorker.start`) and waited for just before sampling, so computing them
overlaps the forward instead of stalling the batch. The worker only calls
llguidance (which releases the GIL); every torch op stays on the engine
thread, whose OpenMP team is the only one (see `Engine.__init__`).

Controls never touch other rows: they write into a copy of the logits, and a
row without controls keeps its bits, so an unconstrained lane picks the same
tokens beside a constrained one as alone.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from llguidance import LLExecutor, LLMatcher
from torch import Tensor

from strata.engine.types import SamplingParams


def has_controls(p: SamplingParams) -> bool:
    """Whether the request's logits need anything before sampling (then its argmax is not plain)."""
    return p.grammar is not None or bool(p.logit_bias) or p.min_tokens > 0


def banned_ids(p: SamplingParams, generated: int, eos_ids: Collection[int], vocab: int) -> list[int]:
    """Token ids that may not be picked next: the stop tokens, while fewer than min_tokens are out.

    The model's EOS ids count unless ignore_eos (then they do not end the request anyway);
    stop_token_ids outside the vocabulary can never be picked and are left out.
    """
    if generated >= p.min_tokens:
        return []
    stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_ids)
    return sorted(t for t in stops if 0 <= t < vocab)


def mask_words(vocab: int) -> int:
    """int32 words in one token bitmask of `vocab` bits."""
    return (vocab + 31) // 32


@dataclass
class GrammarCounters:
    """What grammar masks cost, for `Engine.stats()` and benchmarks."""

    rows: int = 0  # sampled rows that were masked
    wait_s: float = 0.0  # engine thread: waiting for masks plus applying them
    mask_s: float = 0.0  # worker thread: computing them (overlaps the forward)


@dataclass
class PendingMasks:
    """One step's masks on their way: row k of `words` is the mask of step row `rows[k]`."""

    rows: list[int]
    words: Tensor  # [len(rows), mask_words(vocab)] int32 on the host
    done: Future[float] = field(repr=False)  # the worker's seconds; raises what llguidance raised

    def wait(self) -> tuple[Tensor | None, str | None, float]:
        """(words, None, worker seconds), or (None, the error, 0.0) when the computation failed."""
        try:
            return self.words, None, self.done.result()
        except Exception as e:  # an API misuse inside llguidance: the constrained rows end
            return None, f"{type(e).__name__}: {e}", 0.0


class MaskWorker:
    """One worker thread that fills a step's masks, several matchers at once through llguidance."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-grammar")
        self._executor: LLExecutor | None = None  # made on the worker, on first use

    def start(self, rows: list[int], matchers: list[LLMatcher], vocab: int, pin: bool) -> PendingMasks:
        """Begin computing the matchers' next masks; `pin` for logits on a CUDA device."""
        words = torch.zeros((len(matchers), mask_words(vocab)), dtype=torch.int32, pin_memory=pin)
        return PendingMasks(rows, words, self._pool.submit(self._fill, matchers, words))

    def _fill(self, matchers: list[LLMatcher], words: Tensor) -> float:
        start = time.perf_counter()
        if self._executor is None:
            self._executor = LLExecutor()
        n, width = words.shape
        self._executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)],
                                               words.data_ptr(), width * 4, n)
        return time.perf_counter() - start

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def unpack_bitmask(words: Tensor, vocab: int) -> Tensor:
    """Allowed tokens [R, vocab] (bool) from packed int32 words, bit j of word w being token 32 w + j."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).reshape(words.shape[0], -1).bool()
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    allowed = torch.zeros((words.shape[0], vocab), dtype=torch.bool, device=words.device)
    allowed[:, : bits.shape[1]] = bits
    return allowed


def biased(logits: Tensor, biases: Sequence[Mapping[int, float]],
           banned: Sequence[Sequence[int]]) -> Tensor | None:
    """A float copy of `logits` [B, V] with each row's logit_bias added and its banned ids at -inf.

    None when no row has either, so the caller samples from the logits themselves.
    """
    if not any(biases) and not any(banned):
        return None
    scores = logits.float().clone()
    device = scores.device
    rows = [r for r, b in enumerate(biases) for _ in b]
    if rows:
        ids = [t for b in biases for t in b]
        values = torch.tensor([v for b in biases for v in b.values()], dtype=scores.dtype)
        scores.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                          values.to(device), accumulate=True)
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    if rows:
        ids = [t for b in banned for t in b]
        scores[torch.tensor(rows, device=device), torch.tensor(ids, device=device)] = -torch.inf
    return scores


def masked(scores: Tensor, words: Tensor, pairs: Sequence[tuple[int, int]]) -> Tensor:
    """Apply masks in place: for each (row, k), the tokens bit k of `words` disallows get -inf."""
    device = scores.device
    rows = torch.tensor([r for r, _ in pairs], device=device)
    on_device = words.to(device, non_blocking=True)  # the whole (pinned) block, then the rows wanted
    picked = on_device[torch.tensor([k for _, k in pairs], device=device)]
    allowed = unpack_bitmask(picked, scores.shape[1])
    scores[rows] = scores[rows].masked_fill(~allowed, -torch.inf)
    return scores
