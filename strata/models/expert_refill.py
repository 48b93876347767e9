"""Mapped expert reads (`--expert-misses mapped`): the expert cache without a host decision in the step.

A cached layer that copies its missing experts in before it computes must
read the step's routing on the host first: one stall per layer and step,
and steps that cannot be captured in a CUDA graph (docs/MOE.md measured a
one-lane step at 63.6 ms against 6.9 ms with every expert resident). Here a
step does not wait for anything. Each layer's kernels look an expert up in
a device table (`kernels/triton/moe.Mapped`): one with a slot is read from
it, one without is read where it lies, in pinned host memory mapped into
the device's address space, over the bus. The step logs its routing into a
device buffer; after the runner has launched it, `ExpertRefill.after_step`
copies that log to the host, and once a step's log has arrived:

1. counts its hits and misses against the tables that step read;
2. records the use in each layer's `ExpertUsage`;
3. picks, per layer, up to `uploads` of the misses with the most pairs
   that the policy ranks above the resident expert they would replace
   (`kv/expert_residency.admit`).

A slot changes hands in two moves, so no step ever reads a half-written
slot: the victim is unmapped (its table entry set to -1) before the next
step is launched, and the copy stream starts writing the slot only after
that table update, when every step that could still read the old expert
has finished; the new expert is mapped at a later `after_step`, once its
copy is done (a query, never a wait). Every expert is thus read either from
its complete slot or from its host copy, the same bits, by the same kernels
and launch shapes as with every expert resident.

Steps of more rows than a decode step has (prompt pieces) take the cache's
copy path (`ExpertCache.forward`): it finishes the refill's copies first
(`settle`), copies the step's misses in, and publishes its slots afterwards
(`publish`).
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from strata.kv.expert_residency import admit, evict_order

if TYPE_CHECKING:
    from strata.models.experts import ExpertCache

RING = 4  # pinned host buffers for logs and tables in flight
PADDING = 1 << 29  # a padding row's k "experts": PADDING + j, no expert's id (align skips them)


@dataclass
class _Log:
    """One step's routing on its way to the host."""

    host: torch.Tensor  # pinned [L, pairs] int64
    pairs: int  # the step's real (token, expert) pairs, per layer
    arrived: torch.cuda.Event | None  # None: copied synchronously (a CPU device)
    tables: np.ndarray  # [L, E]: the tables the step read


@dataclass
class _Copies:
    """Experts being copied into slots, and when they are done."""

    done: torch.cuda.Event | None
    moves: list[tuple[int, int, int]]  # (layer, expert, slot)


class ExpertRefill:
    """The between-steps half of mapped expert reads for a model's cached layers (module docstring).

    `caches`: every cached layer, in model order (each gets its log and table rows here);
    `uploads`: experts copied into one layer's slots per step at most; `top_k`: pairs per token;
    `rows`: the most rows a mapped step has (decode steps, padded as CUDA graphs pad them: a
    graph must never take the copy path); steps of more rows (prompt pieces) copy their misses in,
    which reads each missing expert over the bus once rather than once per block of its pairs.
    """

    def __init__(self, caches: list[ExpertCache], top_k: int, uploads: int, device: torch.device,
                 rows: int) -> None:
        if not caches:
            raise ValueError("ExpertRefill: no cached layers")
        if uploads < 0 or rows < 1:
            raise ValueError(f"ExpertRefill: {uploads} uploads a step, mapped steps of {rows} rows")
        experts = caches[0].num_experts
        if any(c.num_experts != experts for c in caches):
            raise ValueError("ExpertRefill: the cached layers have different numbers of experts")
        self.caches = caches
        self.top_k = top_k
        self.uploads = uploads
        self.device = device
        self.cuda = device.type == "cuda"
        self.rows = rows
        self.valid = torch.full((1,), rows, dtype=torch.int64, device=device)  # the step's real rows
        self.row_index = torch.arange(rows, dtype=torch.int64, device=device)[:, None]
        self.padding = PADDING + torch.arange(top_k, dtype=torch.int64, device=device)
        layers, self.capacity = len(caches), rows * top_k
        self.logs = torch.zeros((layers, self.capacity), dtype=torch.int64, device=device)
        self.tables = torch.full((layers, experts), -1, dtype=torch.int64, device=device)
        self.table = np.full((layers, experts), -1, dtype=np.int64)  # what steps launched from now read
        self._log_ring = [torch.zeros((layers, self.capacity), dtype=torch.int64, pin_memory=self.cuda)
                          for _ in range(RING)]
        self._table_ring = [torch.full((layers, experts), -1, dtype=torch.int64, pin_memory=self.cuda)
                            for _ in range(RING)]
        self._table_done: list[torch.cuda.Event | None] = [None] * RING
        self._next_log = self._next_table = 0
        self._logs: deque[_Log] = deque()
        self._copying: deque[_Copies] = deque()
        self.copies = torch.cuda.Stream(device) if self.cuda else None
        for j, cache in enumerate(caches):
            cache.attach(self, j, self.logs[j], self.tables[j])
            self.table[j] = cache.slot_of  # slots filled before (a warm cache)
        self._dirty = bool((self.table >= 0).any())
        self._publish()

    # ---- the step's side -------------------------------------------------------------
    def takes(self, rows: int) -> bool:
        """Whether a step of `rows` rows reads its misses in place (else the copy path)."""
        return rows <= self.rows

    def before_step(self, rows: int) -> None:
        """The runner is about to launch a step of `rows` real rows: a CUDA graph pads the lanes,
        and the padding rows must read no expert (from the host, each would cost a read over
        the bus), so the step's real row count goes to the device first (stream-ordered)."""
        if self.takes(rows):
            self.valid.fill_(rows)

    def unpadded(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, k] with the rows past the step's real ones routed to no expert (`PADDING`):
        no block of pairs, no read, nothing logged; their outputs are garbage nobody reads."""
        return torch.where(self.row_index[: ids.shape[0]] < self.valid, ids, self.padding)

    def after_step(self, rows: int) -> None:
        """The runner launched a step of `rows` real rows: fetch its log, act on the logs that have
        arrived, and order this round's table changes and copies after it."""
        read = self.table.copy()  # what the step just launched reads: changes below are for the next
        self._map_finished()
        moves = self._fetch(rows * self.top_k, read) if self.takes(rows) else []
        moves += self._digest()
        self._publish()
        self._copy(moves)

    # ---- the copy path's side ----------------------------------------------------------
    def settle(self) -> None:
        """Before a copy-path step: every refill copy finished and mapped (the compute stream
        waits for them), every log that has arrived digested. The copy path then owns the slots."""
        while self._logs:
            self._digest_one(self._logs.popleft(), wait=True, choose=False)
        for batch in self._copying:
            if batch.done is not None:
                torch.cuda.current_stream(self.device).wait_event(batch.done)
            self._mark_mapped(batch)
        self._copying.clear()

    def publish(self, layer: int) -> None:
        """After a copy-path step of `layer`: its table is its slots as they now are (every held
        expert complete, the step having waited for its copies)."""
        self.table[layer] = self.caches[layer].slot_of
        self._dirty = True
        self._publish()

    # ---- internals -----------------------------------------------------------------------
    def _fetch(self, pairs: int, read: np.ndarray) -> list[tuple[int, int, int]]:
        """Copy the step's logs to a pinned buffer behind the step (it arrives with the step's end);
        returns the copies chosen from a log digested early to free its buffer."""
        moves = []
        if len(self._logs) == RING:  # the oldest has surely arrived by now, or we wait for it
            moves = self._digest_one(self._logs.popleft(), wait=True)
        host = self._log_ring[self._next_log]
        self._next_log = (self._next_log + 1) % RING
        host.copy_(self.logs, non_blocking=self.cuda)  # whole (contiguous): one copy, the other direction
        arrived = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        self._logs.append(_Log(host, pairs, arrived, read))
        return moves

    def _digest(self) -> list[tuple[int, int, int]]:
        moves: list[tuple[int, int, int]] = []
        while self._logs and (self._logs[0].arrived is None or self._logs[0].arrived.query()):
            moves += self._digest_one(self._logs.popleft())
        return moves

    def _digest_one(self, log: _Log, wait: bool = False, choose: bool = True) -> list[tuple[int, int, int]]:
        """Count, record and (choose) pick the copies of one log (steps 1-3 of the docstring);
        wait: for it to arrive."""
        if wait and log.arrived is not None:
            log.arrived.synchronize()
        routed = log.host[:, : log.pairs].numpy()
        moves = []
        for j, cache in enumerate(self.caches):
            need, count = np.unique(routed[j], return_counts=True)
            real = need < cache.num_experts  # not a padding row's
            need, count = need[real], count[real]
            seen = log.tables[j][need] >= 0
            cache.stats.hits += int(seen.sum())
            cache.stats.misses += int((~seen).sum())
            cache.stats.mapped_reads += int((~seen).sum())
            cache.stats.token_layers += log.pairs // self.top_k
            used = need.tolist()
            if cache.trace is not None:
                cache.trace.append(used)
            cache.usage.record(used)
            if choose:
                moves += [(j, e, s) for e, s in self._choose(j, used, need[~seen], count[~seen])]
        return moves

    def _choose(self, j: int, used: list[int], missed: np.ndarray, count: np.ndarray) -> list[tuple[int, int]]:
        """(expert, slot) copies for one layer: the misses with the most pairs first, into free
        slots or over the policy's victims where it admits them; the victims unmapped here."""
        cache = self.caches[j]
        order = sorted(zip(missed.tolist(), count.tolist(), strict=True), key=lambda p: (-p[1], p[0]))
        wanted = [e for e, _ in order if cache.slot_of[e] < 0][: self.uploads]
        if not wanted:
            return []
        busy = {e for batch in self._copying for (layer, e, _) in batch.moves if layer == j}
        free = [s for s, e in enumerate(cache.held) if e < 0]
        victims = [] if len(free) >= len(wanted) else evict_order(
            cache.usage, [e for e in cache.resident() if e not in busy], set(used), cache.policy,
            limit=len(wanted) - len(free))
        chosen = []
        for e in wanted:
            if free:
                s = free.pop(0)
            elif victims and admit(cache.usage, e, victims[0], cache.policy):
                old = victims.pop(0)
                s = cache.slot_of[old]
                cache.slot_of[old] = -1
                self.table[j, old] = -1
                self._dirty = True
            else:
                break
            cache.held[s], cache.slot_of[e] = e, s  # mapped once the copy is done
            chosen.append((e, s))
        return chosen

    def _publish(self) -> None:
        """Order the tables' changes before the next step (one copy of every layer's table)."""
        if not self._dirty:
            return
        i = self._next_table
        self._next_table = (i + 1) % RING
        if self._table_done[i] is not None:
            self._table_done[i].synchronize()  # RING publishes ago: long done
        staged = self._table_ring[i]
        staged.numpy()[:] = self.table
        self.tables.copy_(staged, non_blocking=self.cuda)
        self._table_done[i] = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        self._dirty = False

    def _copy(self, moves: list[tuple[int, int, int]]) -> None:
        """Start the copies into the chosen slots once the steps that might read their victims
        are done (the compute stream's point after the table change)."""
        if not moves:
            return
        stream = self.copies
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for j, e, s in moves:
                cache = self.caches[j]
                for src, dst in zip(cache.host_tensors(), cache.slot_tensors(), strict=True):
                    dst[s].copy_(src[e], non_blocking=self.cuda)
                cache.stats.bytes_uploaded += cache.expert_bytes
        self._copying.append(_Copies(stream.record_event() if stream is not None else None, moves))

    def _map_finished(self) -> None:
        while self._copying and (self._copying[0].done is None or self._copying[0].done.query()):
            self._mark_mapped(self._copying.popleft())

    def _mark_mapped(self, batch: _Copies) -> None:
        for j, e, s in batch.moves:
            if self.caches[j].slot_of[e] == s:
                self.table[j, e] = s
                self._dirty = True

