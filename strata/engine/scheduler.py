"""Lanes, admission and step planning over the shared KV pool.

A lane is a row of the pool's chunk tables. It is busy (a request is reading its prompt
or decoding), idle (it keeps the conversation it last served, for prefix
reuse) or empty. The scheduler admits waiting requests in arrival order to
free lanes, reserves pool chunks, evicts idle lanes' conversations when the
pool is full (order from `kv.policy`), and plans each step: a chunk of
prompt for reading lanes and one token for every decoding lane.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.engine.request import Request
from strata.errors import BadRequest, KvPoolFull, PartMissing
from strata.kv.policy import IdleLane, choose_evictions
from strata.kv.step import SeqSpec
from strata.kv.tables import TablePool

if TYPE_CHECKING:
    from strata.engine.checkpoints import Checkpoints
    from strata.engine.parking import Parking


@dataclass
class Lane:
    index: int
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V the lane holds, in order
    request: Request | None = None
    pending: int | None = None  # sampled token still to be fed to the model
    drafts: list[int] = field(default_factory=list)  # drafted tokens to feed after it (speculative.py)
    last_used: float = 0.0

    def carry(self, drafts: list[int]) -> None:
        """Feed `drafts` after the pending token in the next step (speculative.py)."""
        self.drafts = list(drafts)

    def take_drafts(self) -> list[int]:
        """The drafts the last step fed, handed over for verification; the lane carries none now."""
        drafts, self.drafts = self.drafts, []
        return drafts

    def keep_pending(self) -> None:
        """The pending token's K/V is in the pool (fed by the last step): the lane holds it now."""
        assert self.pending is not None
        self.tokens.append(self.pending)
        self.pending = None


@dataclass
class Counters:
    prefix_reuse_hits: int = 0
    prefix_tokens_reused: int = 0
    refusals: int = 0
    truncations: int = 0
    evictions: int = 0
    moves: int = 0
    parks: int = 0
    restores: int = 0
    restored_tokens: int = 0
    restore_misses: int = 0  # parked conversations a remote stage no longer held


@dataclass
class Step:
    seqs: list[SeqSpec]
    lanes: list[Lane]
    tokens: list[int]  # flattened input ids
    sample: list[int]  # per seq: how many of its last rows are sampled (0, 1, or a verified run's all)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, pool: TablePool, lanes: int, prefill_chunk: int, retry_after: float = 1.0,
                 prefix_reuse: bool = True, parking: Parking | None = None,
                 checkpoints: Checkpoints | None = None, cuts_within_steps: bool = False) -> None:
        """checkpoints: a recurrent model's state checkpoints (`checkpoints.py`); a lane then
        resumes only from its whole conversation or from a checkpoint, never from another cut.
        cuts_within_steps: the model keeps its state at cut points inside a step
        (`SeqSpec.cuts`), so a prompt read does not stop at them (except in a step that
        verifies drafts)."""
        self.pool = pool
        self.prefix_reuse = prefix_reuse
        self.lanes = [Lane(i) for i in range(lanes)]
        self.prefill_chunk = prefill_chunk
        self.retry_after = retry_after
        self.waiting: deque[Request] = deque()
        self.counters = Counters()
        self.parking = parking  # conversations displaced from lanes go there (the conversation cache)
        self.checkpoints = checkpoints
        self.cuts_within_steps = cuts_within_steps

    # ---- admission ----------------------------------------------------------
    def free_lanes(self) -> list[Lane]:
        return [lane for lane in self.lanes if lane.request is None]

    def next_admissible(self) -> Request | None:
        """Take the first waiting request that can have a lane now, or None.

        Arrival order, except that a request pinned to a busy lane (`SamplingParams.lane`) waits
        for it while later ones go by. A pin outside the lanes is taken too: `admit` refuses it.
        """
        free = {lane.index for lane in self.free_lanes()}
        for req in self.waiting:
            pin = req.params.lane
            if pin is None and free or pin is not None and (pin in free or not 0 <= pin < len(self.lanes)):
                self.waiting.remove(req)
                return req
        return None

    def pick_lane(self, prompt: list[int], pin: int | None = None) -> tuple[Lane, int]:
        """The free lane to serve `prompt` and how many of its tokens it already holds.

        The lane sharing the longest prefix wins; else an empty lane; else the
        least recently used idle one. At least the last prompt token is read
        again, since its logits are needed. `pin`: that lane, whatever it holds.
        """
        if pin is not None:
            if not 0 <= pin < len(self.lanes):
                raise BadRequest(f"no lane {pin}: lanes are 0..{len(self.lanes) - 1}", "id_slot")
            lane = self.lanes[pin]
            shared = min(common_prefix(lane.tokens, prompt), len(prompt) - 1) if self.prefix_reuse else 0
            return lane, self._usable(lane, shared)
        free = self.free_lanes()
        best, best_m = None, 0
        for lane in free if self.prefix_reuse else []:
            m = self._usable(lane, min(common_prefix(lane.tokens, prompt), len(prompt) - 1))
            if m > best_m:
                best, best_m = lane, m
        if best is not None:
            return best, best_m
        empty = [lane for lane in free if not lane.tokens]
        if empty:
            return empty[0], 0
        return min(free, key=lambda lane: lane.last_used), 0

    def _usable(self, lane: Lane, shared: int) -> int:
        """How much of a lane's conversation sharing `shared` tokens with a prompt can be kept: all
        of them, except with a recurrent model's state, which resumes only from the lane's whole
        conversation or a checkpoint."""
        if self.checkpoints is None or shared == len(lane.tokens):
            return shared
        return self.checkpoints.best(lane.index, shared)

    def reserve_for(self, lane: Lane, n_tokens: int) -> bool:
        """Reserve chunks for `lane` to hold `n_tokens`, evicting idle lanes' caches if needed."""
        if self.pool.reserve(lane.index, n_tokens):
            return True
        need = self.pool.chunks_for(n_tokens) - self.pool.reserved[lane.index]
        idle = [
            IdleLane(other.index, self.pool.reserved[other.index], other.last_used)
            for other in self.lanes
            if other.request is None and other is not lane and other.tokens
        ]
        chosen = choose_evictions(need, self.pool.free_chunks, idle)
        if chosen is None:
            return False
        for index in chosen:
            self.drop_cache(self.lanes[index])
        return self.pool.reserve(lane.index, n_tokens)

    def drop_cache(self, lane: Lane) -> None:
        """An idle lane gives its cached conversation's chunks back (parked first, if on)."""
        self.give_way(lane, 0)
        self.counters.evictions += 1

    def give_way(self, lane: Lane, keep: int) -> None:
        """The lane keeps only its first `keep` tokens; the whole conversation is parked first."""
        if not lane.tokens[keep:]:
            return
        if self.parking is not None and len(lane.tokens) - keep > 1 and self.parking.park(lane):
            self.counters.parks += 1
        lane.tokens = lane.tokens[:keep]
        self.pool.release(lane.index, keep_tokens=keep)
        if self.checkpoints is not None:
            self.checkpoints.cut(lane.index, keep)

    def admit(self, req: Request) -> Lane:
        """Put `req` in a lane, reusing a cached prefix; raise KvPoolFull if no room."""
        lane, m = self.pick_lane(req.prompt, req.params.lane)
        if self.checkpoints is not None:
            return self._admit_resumed(req, lane, m)
        hit = None
        if self.parking is not None and self.prefix_reuse:
            hit = self.parking.find(req.prompt)
        if hit is not None and hit[1] > m:
            # a parked conversation shares more: the lane's own gives way entirely
            self.give_way(lane, 0)
            m = 0
        else:
            hit = None
            self.give_way(lane, m)  # the lane's conversation diverges at m
        if not self.reserve_for(lane, len(req.prompt)):
            self.counters.refusals += 1
            raise KvPoolFull(
                f"KV pool full: {len(req.prompt)} prompt tokens need "
                f"{self.pool.chunks_for(len(req.prompt))} chunks of {self.pool.chunk_size} cells, "
                f"{self.pool.free_chunks} free and no idle conversation left to evict",
                retry_after=self.retry_after,
            )
        if hit is not None and hit[0] not in self.parking.cache.entry_ids():  # type: ignore[union-attr]
            hit = None  # parking displaced conversations on the way evicted it
        if hit is not None:
            try:
                self.parking.restore(lane, hit[0], hit[1])  # type: ignore[union-attr]
                m = hit[1]
                self.counters.restores += 1
                self.counters.restored_tokens += m
            except PartMissing:  # a remote stage restarted: the prompt is read from token 0
                lane.tokens = []
                m = 0
                self.counters.restore_misses += 1
        elif m:
            self.counters.prefix_reuse_hits += 1
            self.counters.prefix_tokens_reused += m
        req.cursor = m
        req.cached = m
        lane.request = req
        lane.pending = None
        req.handle.placed(lane.index)
        return lane

    def _admit_resumed(self, req: Request, lane: Lane, m: int) -> Lane:
        """`admit` for a recurrent model: the lane's state covers its whole conversation, so a
        shared prefix `m` shorter than that is usable only from a checkpoint at or before it; a
        parked conversation only from one of its saved states (`parking.py`)."""
        cps = self.checkpoints
        assert cps is not None
        whole = m > 0 and m == len(lane.tokens)
        if not whole:
            m = cps.best(lane.index, m)
        hit = self.parking.find(req.prompt) if self.parking is not None and self.prefix_reuse else None
        if hit is not None and hit[1] > m:
            self.give_way(lane, 0)
            m, whole = 0, False
        else:
            hit = None
            self.give_way(lane, m)
        if not self.reserve_for(lane, len(req.prompt)):
            self.counters.refusals += 1
            raise KvPoolFull(
                f"KV pool full: {len(req.prompt)} prompt tokens need "
                f"{self.pool.chunks_for(len(req.prompt))} chunks of {self.pool.chunk_size} cells, "
                f"{self.pool.free_chunks} free and no idle conversation left to evict",
                retry_after=self.retry_after,
            )
        if hit is not None and hit[0] in self.parking.cache.entry_ids():  # type: ignore[union-attr]
            self.parking.restore(lane, hit[0], hit[1])  # type: ignore[union-attr]
            m = hit[1]
            self.counters.restores += 1
            self.counters.restored_tokens += m
        elif whole:
            cps.save(lane.index, m)  # the end of the last answer: a cut point of the chat
        else:
            cps.resume(lane.index, m)
            if m:
                self.counters.prefix_reuse_hits += 1
                self.counters.prefix_tokens_reused += m
        if whole:
            self.counters.prefix_reuse_hits += 1
            self.counters.prefix_tokens_reused += m
        req.cursor = req.cached = m
        req.cuts = cps.cut_points(m, len(req.prompt), req.params.cut_points)
        lane.request = req
        lane.pending = None
        req.handle.placed(lane.index)
        return lane

    def move(self, src: Lane, dst: Lane) -> None:
        """Move src's conversation into dst by swapping chunk tables (no K/V copy)."""
        assert src.request is None and dst.request is None
        self.pool.swap(src.index, dst.index)
        if self.checkpoints is not None:
            self.checkpoints.swap(src.index, dst.index)
        src.tokens, dst.tokens = dst.tokens, src.tokens
        src.last_used, dst.last_used = dst.last_used, src.last_used
        self.counters.moves += 1

    # ---- planning --------------------------------------------------------------
    def plan(self) -> tuple[Step, list[Lane]]:
        """The next step, and the decoding lanes that could not grow (to be truncated)."""
        seqs: list[SeqSpec] = []
        lanes: list[Lane] = []
        tokens: list[int] = []
        sample: list[int] = []
        stuck: list[Lane] = []
        for lane in self.lanes:
            req = lane.request
            if req is None or req.prefilling or lane.pending is None:
                continue
            pos = len(lane.tokens)
            if self.pool.backed(lane.index) <= pos and not self.reserve_for(lane, pos + 1):
                stuck.append(lane)
                lane.drafts = []
                continue
            n = 1 + len(lane.drafts)  # drafts take free chunks only: no conversation is evicted for them
            if self.pool.backed(lane.index) < pos + n and not self.pool.reserve(lane.index, pos + n):
                lane.drafts = lane.drafts[: self.pool.backed(lane.index) - pos - 1]
                n = 1 + len(lane.drafts)
            seqs.append(SeqSpec(lane.index, pos, n, drafted=n > 1))
            lanes.append(lane)
            tokens.append(lane.pending)
            tokens.extend(lane.drafts)
            sample.append(n)
        budget = self.prefill_chunk
        inside = self.cuts_within_steps and not any(s.drafted for s in seqs)
        reading = [lane for lane in self.lanes if lane.request is not None and lane.request.prefilling]
        reading.sort(key=lambda lane: lane.request.id)  # type: ignore[union-attr]
        for lane in reading:
            if budget <= 0:
                break
            req = lane.request
            assert req is not None
            n = min(budget, len(req.prompt) - req.cursor)
            cut = next((c for c in req.cuts if c > req.cursor), None)
            if cut is not None and not inside:  # the read stops there to checkpoint the state
                n = min(n, cut - req.cursor)
            cuts = tuple(c - req.cursor for c in req.cuts if req.cursor < c < req.cursor + n) if inside else ()
            seqs.append(SeqSpec(lane.index, req.cursor, n, prompt=True, cuts=cuts))
            lanes.append(lane)
            tokens.extend(req.prompt[req.cursor : req.cursor + n])
            sample.append(req.cursor + n == len(req.prompt))
            budget -= n
        return Step(seqs, lanes, tokens, sample), stuck

    def forget_idle(self) -> None:
        """Idle lanes drop their cached conversations without parking them: part of their K/V is
        gone (a remote stage's worker was lost), so none of it may be reused."""
        for lane in self.lanes:
            if lane.request is None and lane.tokens:
                self.forget(lane)

    def forget(self, lane: Lane) -> int:
        """An idle lane drops its conversation, not parked: no later request may reuse it.
        Returns how many tokens it held."""
        assert lane.request is None, "only an idle lane forgets its conversation"
        n = len(lane.tokens)
        lane.tokens = []
        self.pool.release(lane.index)
        if self.checkpoints is not None:
            self.checkpoints.cut(lane.index, 0)
        return n

    def release_lane(self, lane: Lane, keep_cache: bool) -> None:
        """The lane's request is over: keep its conversation for reuse, or give it all back."""
        lane.request = None
        lane.pending = None
        lane.drafts = []
        lane.last_used = time.monotonic()
        if not keep_cache:
            lane.tokens = []
            self.pool.release(lane.index)
            if self.checkpoints is not None:
                self.checkpoints.cut(lane.index, 0)
