"""The host-to-device copies of streamed K/V: one engine for every path that reads the host store.

A streamed pool (kv/stream.py) keeps every cell in its host store (pinned on
CUDA) and a device block cache, `store.area`. Everything that moves cells
between the two goes through `StreamCopies`, one per store:
- misses, enqueued per layer on a copy stream (CUDA) with one event per
  layer, waited for by the compute stream right before that layer reads:
  by ONE gather launch per layer reading the pinned store in place
  (kernels/triton/gather.py), or one `copy_` per run of consecutive cells;
  with overlap they run `prefetch` layers ahead (scratch is a ring of
  `prefetch` regions) while earlier layers compute;
- `copy_now`: the same copies, waited for at once (the reference read path);
- write-behind: new K/V staged on the device, copied to pinned staging after
  the last layer (non_blocking, one event) and scattered into the host store
  at the next step's start or at `settle()`.

Without CUDA (tests, Triton's interpreter) every copy happens at once and no
streams are made. Ordering rules: docs/GPU_STREAMING.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from strata.kv.formats import Storage

if TYPE_CHECKING:
    from strata.kv.stream import StreamStore

try:  # the CPU path must not need Triton
    from strata.kernels.triton.gather import MAX_RUNS, block_words, default_programs, gather_blocks

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the installation
    HAVE_TRITON = False

DEFAULT_PREFETCH = 2  # layers whose copies may be in flight ahead of the compute (scratch regions)
SCRATCH_SLACK = 1.25  # a scratch region grows to this times the overflow that outgrew it

Run = tuple[int, int, int]  # (first host cell or block, first area row or block, count)


def coalesce(src: np.ndarray, dst: np.ndarray) -> list[Run]:
    """Runs of blocks consecutive in both the host store and the area, in order of `src`."""
    if src.size == 0:
        return []
    order = np.argsort(src, kind="stable")
    s, d = src[order], dst[order]
    brk = np.nonzero((np.diff(s) != 1) | (np.diff(d) != 1))[0] + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [s.size]])
    return [(int(s[a]), int(d[a]), int(b - a)) for a, b in zip(starts, ends)]


@dataclass
class WriteBehind:
    """New K/V of one step on their way to the host store."""

    cells: torch.Tensor  # [T] pool cells (host)
    tokens: int
    layers: set[int] = field(default_factory=set)  # staged: layer l at rows [l * T, (l + 1) * T)
    dirty: bool = False  # staged since the last copy to pinned memory
    event: torch.cuda.Event | None = None  # that copy's end

    def stage(self, layer: int) -> None:
        """Layer `layer`'s new K/V are in the device staging area."""
        self.layers.add(layer)
        self.dirty = True

    def take(self) -> bool:
        """Whether anything was staged since the last copy to pinned memory (and now it is not)."""
        dirty, self.dirty = self.dirty, False
        return dirty


class StreamCopies:
    """Per store, across steps: the copy stream, events, scratch layout and write-behind buffers."""

    def __init__(self, store: StreamStore, prefetch: int = DEFAULT_PREFETCH) -> None:
        self.store = store
        self.device = store.device
        self.cuda = store.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.prefetch = max(1, prefetch)
        n = len(store.host)
        self.layer_read: list[torch.cuda.Event | None] = [None] * n  # last attention of each layer
        self.region_read: list[torch.cuda.Event | None] = []  # last attention over each region
        self.copied: list[torch.cuda.Event | None] = [None] * n  # this step's copies per layer
        self.last_copy: torch.cuda.Event | None = None
        self.ring = 0
        self.region_blocks = 0
        self.stage_dev: Storage | None = None  # [layers * T] new K/V, written on the compute stream
        self.stage_host: Storage | None = None  # its pinned copy
        self.behind: WriteBehind | None = None
        # the gather path: the step's pairs upload (the copy stream waits for it), programs of
        # a launch, word views of the host store per layer and of the area
        self.meta_ready: torch.cuda.Event | None = None
        self.programs = 0
        self._host_words: dict[int, list[torch.Tensor]] = {}
        self._area_words: tuple[tuple[int, ...], list[torch.Tensor]] | None = None
        self._gather_ok: bool | None = None
        # copy-stream timing (benchmarks): (start, end) events of each layer's copies
        self.timing = False
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # ---- the gather path ---------------------------------------------------------
    def use_gather(self) -> bool:
        """Whether this step copies by the gather kernel (`store.gather`).

        None picks it on CUDA where it can run: Triton present, the host store
        pinned (zero-copy reads need page-locked memory) and contiguous, at most
        MAX_RUNS runs per cell. True also runs it on the CPU (Triton's interpreter).
        """
        want = self.store.gather
        if want is False or not HAVE_TRITON:
            return False
        if want is None and not self.cuda:
            return False
        if self._gather_ok is None:
            st = self.store
            ts = [t for layer in st.host for t in layer.values()]
            ok = len(st.host[0]) <= MAX_RUNS and all(t.is_contiguous() for t in ts)
            if self.cuda:
                ok = ok and all(t.is_pinned() for t in ts)
            self._gather_ok = ok
        return self._gather_ok

    def _words(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(host views, area views) of whole blocks in words, per run of the format."""
        st = self.store
        host = self._host_words.get(layer)
        if host is None:
            host = self._host_words[layer] = [block_words(t, st.block) for t in st.host[layer].values()]
        key = tuple(t.data_ptr() for t in st.area.values())
        if self._area_words is None or self._area_words[0] != key:
            self._area_words = (key, [block_words(t, st.block) for t in st.area.values()])
        return host, self._area_words[1]

    def _gather(self, layer: int, pairs: torch.Tensor) -> None:
        if not self.programs:
            self.programs = default_programs(self.device)
        srcs, dsts = self._words(layer)
        gather_blocks(pairs, srcs, dsts, self.programs)

    # ---- scratch --------------------------------------------------------------
    def layout(self, ring: int, overflow: int) -> None:
        """Scratch of `ring` regions of at least `overflow` blocks; a change waits for the device."""
        st = self.store
        blocks = self.region_blocks
        if overflow > blocks:
            blocks = max(overflow, int(overflow * SCRATCH_SLACK))
        if ring == self.ring and blocks == self.region_blocks:
            return
        self.wait_idle()  # in-flight copies and reads use the old layout
        st.grow_area(st.scratch0 + ring * blocks * st.block)
        self.ring, self.region_blocks = ring, blocks
        self.region_read = [None] * ring

    def region_base(self, layer: int) -> int:
        """First area block of the scratch region layer `layer` uses."""
        st = self.store
        return st.scratch0 // st.block + (layer % self.ring) * self.region_blocks

    # ---- copies ----------------------------------------------------------------
    def enqueue(self, layer: int, runs: list[Run], overlap: bool,
                pairs: torch.Tensor | None = None) -> None:
        """Copy layer `layer`'s misses host -> area on the copy stream; `copied[layer]` marks the end.

        `pairs` ([n, 2] (host block, area block) on the device, from the step's
        upload): one gather launch; else one `copy_` per run of `runs`, each
        (first host cell, first area row, cells). The
        copy stream first waits for whatever still reads the rows it
        overwrites: with overlap, the last attention of this layer (its slots)
        and the last attention over its scratch region; without, everything
        the compute stream has been given so far. A gather also waits for the
        step's metadata upload (`meta_ready`), which holds its pairs.
        """
        st = self.store
        host, area = st.host[layer], st.area
        if not self.cuda:
            if pairs is not None:
                self._gather(layer, pairs)
                return
            for src, dst, n in runs:
                for name, t in area.items():
                    t[dst : dst + n].copy_(host[name][src : src + n])
            return
        if (pairs is None and not runs) or (pairs is not None and pairs.shape[0] == 0):
            self.copied[layer] = None
            return
        assert self.copy_stream is not None
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            if overlap:
                for ev in (self.layer_read[layer], self.region_read[layer % self.ring]):
                    if ev is not None:
                        self.copy_stream.wait_event(ev)
            else:
                self.copy_stream.wait_stream(main)
            if self.timing:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.copy_stream)
            if pairs is not None:
                if overlap and self.meta_ready is not None:
                    self.copy_stream.wait_event(self.meta_ready)
                self._gather(layer, pairs)
            else:
                for src, dst, n in runs:
                    for name, t in area.items():
                        t[dst : dst + n].copy_(host[name][src : src + n], non_blocking=True)
            ev = torch.cuda.Event(enable_timing=self.timing)
            ev.record(self.copy_stream)
            if self.timing:
                self.spans.append((start, ev))
        self.copied[layer] = self.last_copy = ev

    def copy_now(self, layer: int, runs: list[Run]) -> None:
        """Copy `runs` of layer `layer` and let the compute stream wait for them (the reference
        read path, which reads right after)."""
        self.enqueue(layer, runs, overlap=False)
        self.before_layer(layer)

    def gather_failed(self) -> None:
        """The gather kernel could not launch: this store copies with `copy_` from now on."""
        self._gather_ok = False

    def copy_ms(self) -> float:
        """Copy-stream busy time (ms) of the copies since the last call (`timing`; waits for them)."""
        spans, self.spans = self.spans, []
        return sum(a.elapsed_time(e) for a, e in spans) if spans else 0.0

    def before_layer(self, layer: int) -> None:
        """The compute stream waits for layer `layer`'s copies (right before its write)."""
        ev = self.copied[layer]
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            self.copied[layer] = None

    def after_layer(self, layer: int) -> None:
        """Mark the end of layer `layer`'s reads of its slots and its scratch region."""
        if not self.cuda:
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.layer_read[layer] = ev
        self.region_read[layer % self.ring] = ev

    # ---- write-behind -------------------------------------------------------------
    def begin_step(self, cells: torch.Tensor) -> None:
        """A step whose new K/V go to the host store's `cells` [T] starts (after `flush`)."""
        self.behind = WriteBehind(cells, cells.numel())

    def staged(self, layer: int) -> None:
        """Layer `layer` of this step wrote its new K/V into the staging area."""
        if self.behind is not None:
            self.behind.stage(layer)

    def metadata_uploaded(self, buffer: torch.Tensor) -> None:
        """The step's device metadata (the gather's pairs among it) was enqueued for upload on
        the compute stream: the copy stream waits for that upload, and the allocator keeps
        `buffer` until the copy stream is done with it."""
        self.meta_ready = torch.cuda.Event()
        self.meta_ready.record(torch.cuda.current_stream(self.device))
        assert self.copy_stream is not None
        buffer.record_stream(self.copy_stream)

    def staging(self, rows: int) -> Storage:
        """Device staging for `rows` new cells (all layers of a step)."""
        st = self.store
        if self.stage_dev is None or next(iter(self.stage_dev.values())).shape[0] < rows:
            self.stage_dev = st.fmt.allocate(rows, st.device)
        return self.stage_dev

    def send_behind(self) -> None:
        """Copy the step's staged K/V to pinned host memory (non_blocking) and mark it with an event."""
        bh = self.behind
        if bh is None or not bh.take():
            return
        rows = (max(bh.layers) + 1) * bh.tokens
        if rows == 0:
            return
        assert self.stage_dev is not None
        if self.stage_host is None or next(iter(self.stage_host.values())).shape[0] < rows:
            have = 0 if self.stage_host is None else next(iter(self.stage_host.values())).shape[0]
            self.stage_host = self.store.fmt.allocate(max(rows, 2 * have), "cpu", pin=self.cuda)
        for name, t in self.stage_dev.items():
            self.stage_host[name][:rows].copy_(t[:rows], non_blocking=self.cuda)
        if self.cuda:
            bh.event = torch.cuda.Event()
            bh.event.record(torch.cuda.current_stream(self.device))

    def flush(self) -> None:
        """Scatter the last step's new K/V into the host store (waiting for their copy if needed)."""
        bh = self.behind
        if bh is None:
            return
        self.send_behind()
        if bh.event is not None:
            bh.event.synchronize()
        t = bh.tokens
        if bh.layers and t:
            assert self.stage_host is not None
            for layer in sorted(bh.layers):
                for name, dest in self.store.host[layer].items():
                    dest.index_copy_(0, bh.cells, self.stage_host[name][layer * t : (layer + 1) * t])
        self.behind = None

    def wait_idle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def settle(self) -> None:
        """Host store current and no copy out of it in flight."""
        self.flush()
        if self.last_copy is not None:
            self.last_copy.synchronize()
