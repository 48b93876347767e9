"""Grammar masks beside the forward: started before a step runs, waited for just before sampling.

llguidance computes each constrained row's allowed tokens on the host, one
bit per token. A step's masks are started on a worker thread before its
forward runs and waited for in post-processing, so computing them overlaps
the forward instead of stalling the batch. The worker only calls llguidance
(which releases the GIL, and computes several matchers in parallel); every
torch op stays on the engine thread, whose OpenMP team is the only one (see
`Engine.__init__`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from llguidance import LLExecutor, LLMatcher
from torch import Tensor

from strata.engine.controls import mask_words, masked
from strata.engine.scheduler import Lane, Step


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


class GrammarMasks:
    """The engine's mask worker: one thread, made with the first constrained step."""

    def __init__(self, vocab: int, pin: bool) -> None:
        """`vocab`: the masks' width in bits; `pin`: page-locked host masks, for CUDA logits."""
        self.vocab = vocab
        self.pin = pin
        self.counters = GrammarCounters()
        self._pool: ThreadPoolExecutor | None = None
        self._executor: LLExecutor | None = None  # made on the worker, on first use

    def start(self, step: Step) -> PendingMasks | None:
        """Begin computing the next masks of the step's sampled rows whose request has a matcher."""
        rows = [i for i, (lane, wanted) in enumerate(zip(step.lanes, step.sample))
                if wanted and lane.request is not None and lane.request.matcher is not None]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-grammar")
        matchers = [step.lanes[i].request.matcher for i in rows]  # type: ignore[union-attr, misc]
        words = torch.zeros((len(rows), mask_words(self.vocab)), dtype=torch.int32, pin_memory=self.pin)
        return PendingMasks(rows, words, self._pool.submit(self._fill, matchers, words))

    def _fill(self, matchers: list[LLMatcher], words: Tensor) -> float:
        start = time.perf_counter()
        if self._executor is None:
            self._executor = LLExecutor()
        n, width = words.shape
        self._executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)],
                                               words.data_ptr(), width * 4, n)
        return time.perf_counter() - start

    def wait(self, pending: PendingMasks, lanes: list[Lane],
             rows: list[int]) -> tuple[Tensor | None, list[tuple[Lane, str]]]:
        """The masks, and the lanes (of `lanes`, at step rows `rows`) whose matcher failed, with why."""
        start = time.perf_counter()
        try:
            words: Tensor | None = pending.words
            self.counters.mask_s += pending.done.result()
            error = None
        except Exception as e:  # an API misuse inside llguidance: the constrained rows end
            words, error = None, f"{type(e).__name__}: {e}"
        self.counters.wait_s += time.perf_counter() - start
        failed = []
        for lane, i in zip(lanes, rows):
            matcher = lane.request.matcher if lane.request is not None else None
            if matcher is not None and i in pending.rows and (error or matcher.is_error()):
                failed.append((lane, error or matcher.get_error()))
        return words, failed

    def apply(self, scores: Tensor, pending: PendingMasks, words: Tensor, rows: list[int]) -> Tensor:
        """`scores` (the sampled rows at step rows `rows`) with disallowed tokens at -inf."""
        start = time.perf_counter()
        pairs = [(j, pending.rows.index(i)) for j, i in enumerate(rows) if i in pending.rows]
        if pairs:
            scores = masked(scores, words, pairs)
            self.counters.rows += len(pairs)
        self.counters.wait_s += time.perf_counter() - start
        return scores

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
