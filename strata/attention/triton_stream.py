"""Streamed K/V (`--kv-resident`) on CUDA: the Triton kernels read the device block cache directly.

A streamed pool keeps every cell in its host store (pinned) and, per layer,
`slots` blocks of `store.block` cells in the device cache `store.area`
(kv/stream.py). The kernels address cells through a table of chunks; here
the "chunk" is the block: per step and layer a translated table
[sequences, blocks] maps a sequence's block index to the block's row in the
area (its resident slot, or a scratch block for a block the cache cannot
hold this step), and the kernels run with that table and chunk size = block
size, over `halves(...)` views of the area. Design and ordering rules:
docs/GPU_STREAMING.md.

One step (`GpuStreamAttention`):
1. on the host, once: the blocks the step reads (the same in every layer),
   every layer's residency (`StreamStore.plan_layers`), the translated
   tables, write cells and kernel metadata, uploaded in one copy;
2. the misses of layer L (admitted blocks into their slots, overflow blocks
   into a scratch region) are copied straight from the pinned host store on
   a copy stream, by ONE gather launch per layer that reads the pinned store
   in place (kernels/triton/gather.py; its (source, destination) block pairs came
   with the step's metadata), or, as the fallback, one `copy_` per run of
   consecutive blocks; one event per layer; the compute stream waits on layer L's event only right before
   layer L's write. With `store.overlap` the copies of layer L are enqueued
   `prefetch` layers ahead (scratch is a ring of `prefetch` regions), so they
   run while earlier layers compute; without it each layer copies, then waits;
3. new K/V go into the cache rows by the Triton write kernel, and a second
   time into a device staging area, copied to pinned staging after the last
   layer (non_blocking, one event) and scattered into the host store on the
   host at the next step's start or at `store.settle()`.

Without CUDA (tests, Triton's interpreter) the same code runs with every
copy done at once and no streams (`copy_`, or the gather kernel under the
interpreter when `store.gather` is True).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from strata.attention.reference import SeqSpec, TableAttention
from strata.kv.formats import K8V4Format, PlainFormat, Storage
from strata.kv.pool import KvPool
from strata.kv.stream import StreamStore

try:  # the CPU path must not need Triton
    from strata.attention.triton_pool import _sms
    from strata.kernels.triton.decode import DecodeBatch, decode_attention
    from strata.kernels.triton.gather import MAX_RUNS, block_words, default_programs, gather_blocks
    from strata.attention.layout import halves, supported
    from strata.kernels.triton.prefill import PrefillBatch, prefill_attention, query_blocks
    from strata.kernels.triton.write import write_plain, write_quantized

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the installation
    HAVE_TRITON = False

DEFAULT_PREFETCH = 2  # layers whose copies may be in flight ahead of the compute (scratch regions)
SCRATCH_SLACK = 1.25  # a scratch region grows to this times the overflow that outgrew it


def stream_context(pool: KvPool) -> type:
    """The AttentionContext for a streamed pool: the kernels over the cache on CUDA, else the reference."""
    if (pool.device.type == "cuda" and HAVE_TRITON and isinstance(pool.store, StreamStore)
            and supported(pool.fmt)):
        return GpuStreamAttention
    return TableAttention


Run = tuple[int, int, int]  # (first host block, first area block, blocks)


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
class StepPlan:
    """Host-side result of one step's planning (tests read it)."""

    need: torch.Tensor  # [U] pool blocks the step reads, sorted
    tables: torch.Tensor  # [layers, S, max_blocks] area block of each sequence block
    write_rows: torch.Tensor  # [layers, T] area row of each new token
    cells: torch.Tensor  # [T] pool cells of the new tokens
    pairs: list[np.ndarray]  # per layer: [n, 2] (host block, area block) copies, by host block
    overflow: list[int]  # per layer: blocks read from scratch
    ring: int
    region_blocks: int

    @cached_property
    def runs(self) -> list[list[Run]]:
        """Per layer: the copies as runs of consecutive blocks (the `copy_` path's)."""
        return [coalesce(p[:, 0], p[:, 1]) for p in self.pairs]


@dataclass
class _Behind:
    """New K/V of one step on their way to the host store."""

    cells: torch.Tensor  # [T] pool cells (host)
    tokens: int
    layers: set[int] = field(default_factory=set)  # staged: layer l at rows [l * T, (l + 1) * T)
    dirty: bool = False  # staged since the last copy to pinned memory
    event: torch.cuda.Event | None = None  # that copy's end


class StreamState:
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
        self.behind: _Behind | None = None
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
        """Whether this step copies by the gather kernel (`store.gather`, see kv/stream.py).

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
        cells = st.scratch0 + ring * blocks * st.block
        have = next(iter(st.area.values())).shape[0]
        if cells > have:
            grown = st.fmt.allocate(cells, st.device)
            for name, t in grown.items():
                t[: st.scratch0].copy_(st.area[name][: st.scratch0])
            st.area = grown
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
        upload): one gather launch; else one `copy_` per run of `runs`. The
        copy stream first waits for whatever still reads the rows it
        overwrites: with overlap, the last attention of this layer (its slots)
        and the last attention over its scratch region; without, everything
        the compute stream has been given so far. A gather also waits for the
        step's metadata upload (`meta_ready`), which holds its pairs.
        """
        st = self.store
        b = st.block
        host, area = st.host[layer], st.area
        if not self.cuda:
            if pairs is not None:
                self._gather(layer, pairs)
                return
            for src, dst, n in runs:
                for name, t in area.items():
                    t[dst * b : (dst + n) * b].copy_(host[name][src * b : (src + n) * b])
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
                        t[dst * b : (dst + n) * b].copy_(host[name][src * b : (src + n) * b],
                                                         non_blocking=True)
            ev = torch.cuda.Event(enable_timing=self.timing)
            ev.record(self.copy_stream)
            if self.timing:
                self.spans.append((start, ev))
        self.copied[layer] = self.last_copy = ev

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
    def staging(self, rows: int) -> Storage:
        """Device staging for `rows` new cells (all layers of a step)."""
        st = self.store
        if self.stage_dev is None or next(iter(self.stage_dev.values())).shape[0] < rows:
            self.stage_dev = st.fmt.allocate(rows, st.device)
        return self.stage_dev

    def send_behind(self) -> None:
        """Copy the step's staged K/V to pinned host memory (non_blocking) and mark it with an event."""
        bh = self.behind
        if bh is None or not bh.dirty:
            return
        bh.dirty = False
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


def state_of(store: StreamStore) -> StreamState:
    if store.gpu is None:
        store.gpu = StreamState(store)
    return store.gpu


def plan_step(store: StreamStore, seqs: list[SeqSpec], ring: int) -> StepPlan:
    """Everything the step needs from the host, computed once (see the module docstring)."""
    pool = store.pool
    state = state_of(store)
    B = store.block
    n_layers = len(store.host)
    S = len(seqs)
    ns = torch.tensor([s.n for s in seqs], dtype=torch.int64)
    starts = torch.tensor([s.start for s in seqs], dtype=torch.int64)
    sessions = torch.tensor([s.session for s in seqs], dtype=torch.int64)
    ends = starts + ns
    mb = -(-int(ends.max()) // B) if S else 0
    first = torch.arange(mb, dtype=torch.int64) * B
    chunk = pool.chunk_size
    col = (first // chunk).clamp(max=pool.max_chunks - 1)
    cell0 = pool.tables[sessions][:, col] * chunk + first % chunk  # [S, mb]
    valid = first[None, :] < ends[:, None]
    need, inv = torch.unique(cell0[valid] // B, return_inverse=True)
    plans = store.plan_layers(need)
    slot = torch.stack([p[0] for p in plans]) if plans else torch.empty(0, need.numel())
    over = slot < 0  # [layers, U]
    n_over = over.sum(1)
    state.layout(ring, int(n_over.max()) if n_layers else 0)
    layer_ix = torch.arange(n_layers, dtype=torch.int64)
    base = torch.tensor([state.region_base(layer) for layer in range(n_layers)], dtype=torch.int64)
    scratch = base[:, None] + torch.cumsum(over.to(torch.int64), 1) - 1
    entry = torch.where(over, scratch, layer_ix[:, None] * store.slots + slot)  # [layers, U]
    tables = torch.zeros((n_layers, S, mb), dtype=torch.int64)
    tables[:, valid] = entry[:, inv]
    # new tokens: pool cells (host store) and area rows per layer
    t = int(ns.sum())
    tok_seq = torch.repeat_interleave(torch.arange(S), ns)
    tok_pos = torch.cat([torch.arange(s.start, s.end, dtype=torch.int64) for s in seqs]) if S \
        else torch.empty(0, dtype=torch.int64)
    cells = pool.tables[sessions[tok_seq], tok_pos // chunk] * chunk + tok_pos % chunk
    write_rows = tables[:, tok_seq, tok_pos // B] * B + tok_pos % B  # [layers, T]
    # copies: admitted blocks into their slots, overflow blocks into the layer's region
    need_np = need.numpy()
    pairs, overflow = [], []
    cell_bytes = store.fmt.cell_bytes()
    for layer, (_, admit, slots) in enumerate(plans):
        o = over[layer].numpy()
        src = np.concatenate([admit.numpy(), need_np[o]])
        dst = np.concatenate([layer * store.slots + slots.numpy(),
                              int(base[layer]) + np.arange(int(o.sum()))])
        order = np.argsort(src, kind="stable")
        pairs.append(np.stack([src[order], dst[order]], 1).astype(np.int64))
        overflow.append(int(o.sum()))
    store.stats.overflow_bytes += sum(overflow) * B * cell_bytes
    assert t == cells.numel()
    return StepPlan(need, tables, write_rows, cells, pairs, overflow, ring, state.region_blocks)


class GpuStreamAttention:
    """The AttentionContext of one engine step over a streamed pool: Triton kernels over the cache."""

    def __init__(
        self, pool: KvPool, seqs: list[SeqSpec], num_heads: int, scale: float, dtype: torch.dtype
    ) -> None:
        store = pool.store
        assert isinstance(store, StreamStore)
        self.pool, self.store = pool, store
        self.fmt = pool.fmt
        self.scale, self.dtype, self.num_heads = scale, dtype, num_heads
        self.plain = isinstance(pool.fmt, PlainFormat)
        self.rotate_v = isinstance(pool.fmt, K8V4Format) and pool.fmt.rotate
        self.sms = _sms(store.device)
        self.state = state = state_of(store)
        self.overlap = store.overlap
        self.layers = len(store.host)
        ring = min(state.prefetch, self.layers) if self.overlap else 1
        plan = self.plan = plan_step(store, seqs, ring)  # bookkeeping only: nothing read yet
        state.flush()  # the last step's K/V reach the host store before any copy out of it
        t = plan.cells.numel()
        self.tokens = t
        state.behind = _Behind(plan.cells, t)
        self.stage = state.staging(self.layers * t)
        # kernel metadata, one upload (decode and prefill as in GpuTableAttention; `sessions`
        # index the rows of the step's translated tables)
        ns = torch.tensor([s.n for s in seqs], dtype=torch.int64)
        starts = torch.tensor([s.start for s in seqs], dtype=torch.int64)
        seq_ix = torch.arange(len(seqs), dtype=torch.int64)
        rows = torch.cumsum(ns, 0) - ns
        dec = ns == 1
        pre = ~dec
        blk_seq, blk_m0 = query_blocks(ns[pre].tolist())
        stage_rows = torch.arange(self.layers * t, dtype=torch.int64)
        parts = [
            plan.tables.reshape(-1), plan.write_rows.reshape(-1), stage_rows,
            rows[dec], seq_ix[dec], starts[dec] + 1,
            torch.tensor(blk_seq, dtype=torch.int64), torch.tensor(blk_m0, dtype=torch.int64),
            seq_ix[pre], starts[pre], ns[pre], rows[pre],
        ]
        self.gather = state.use_gather()
        if self.gather:  # every layer's (host block, area block) copies, in the same upload
            parts.append(torch.from_numpy(np.concatenate(plan.pairs).reshape(-1)))
        packed = torch.cat(parts)
        if state.cuda:
            packed = packed.pin_memory().to(store.device, non_blocking=True)
            if self.gather:  # the copy stream reads the pairs: it waits for the upload, and
                # the allocator keeps the buffer until the copy stream is done with it
                state.meta_ready = torch.cuda.Event()
                state.meta_ready.record(torch.cuda.current_stream(store.device))
                assert state.copy_stream is not None
                packed.record_stream(state.copy_stream)
        views = packed.split([p.numel() for p in parts])
        self.tables = views[0].view(plan.tables.shape)
        self.write_rows = views[1].view(plan.write_rows.shape)
        self.stage_rows = views[2].view(self.layers, t)
        self.decode = DecodeBatch(views[3], views[4], views[5],
                                  int(starts[dec].max()) + 1 if bool(dec.any()) else 0)
        self.prefill = PrefillBatch(*views[6:12])
        self.pairs: list[torch.Tensor] = []
        if self.gather:
            self.pairs = list(views[12].view(-1, 2).split([len(p) for p in plan.pairs]))
        self.halves = halves(self.fmt, store.area)
        self.stage_halves = halves(self.fmt, self.stage)
        if self.overlap:
            for layer in range(ring):
                self._enqueue(layer)

    def _enqueue(self, layer: int) -> None:
        """Layer `layer`'s copies: its pairs to the gather kernel, or its runs to `copy_`.

        A gather that cannot launch (a launcher refusing the host pointers, say)
        raises before it enqueues anything: then this store copies with `copy_`
        from here on, with a warning (`use_gather()` says which path runs).
        """
        if self.gather:
            try:
                self.state.enqueue(layer, [], self.overlap, self.pairs[layer])
                return
            except Exception as e:  # noqa: BLE001 - the fallback is exact too
                warnings.warn(f"streamed K/V: the gather kernel failed ({type(e).__name__}: {e}); "
                              "copying with copy_ instead", RuntimeWarning, stacklevel=2)
                self.state._gather_ok = False
                self.gather = False
        self.state.enqueue(layer, self.plan.runs[layer], self.overlap)

    def _write(self, kh, vh, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.plain:
            write_plain(kh.data, vh.data, rows, k, v)
        else:
            write_quantized(kh, vh, rows, k, v, self.rotate_v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v [T, Hkv, D]; causal attention of q [T, Hq, D] over the cache -> [T, Hq, D]."""
        state, plan = self.state, self.plan
        if not self.overlap:
            self._enqueue(layer)
        state.before_layer(layer)
        kh, vh = self.halves
        self._write(kh, vh, self.write_rows[layer], k, v)
        sk, sv = self.stage_halves
        self._write(sk, sv, self.stage_rows[layer], k, v)
        bh = state.behind
        if bh is not None:
            bh.layers.add(layer)
            bh.dirty = True
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        table = self.tables[layer]
        block = self.store.block
        decode_attention(q, out, self.decode, kh, vh, table, block, self.scale, self.sms,
                         self.rotate_v)
        prefill_attention(q, out, self.prefill, kh, vh, table, block, self.scale, self.rotate_v)
        state.after_layer(layer)
        nxt = layer + plan.ring
        if self.overlap and nxt < self.layers:
            self._enqueue(nxt)
        if layer == self.layers - 1:
            state.send_behind()
        return out
