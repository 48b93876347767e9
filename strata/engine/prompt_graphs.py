"""CUDA graphs of one lane's short prompt step, captured per padded row count and replayed.

A later turn of a chat resumes a recurrent model (Qwen3-Next) from its
checkpoint and reads only the new message: a step of a few dozen rows of one
lane. Eagerly that step is hundreds of launches and FLA's Python around its
kernels, 50 ms of host time against a few ms of kernels on an H100
(docs/PERFORMANCE.md), so the later turn costs a third of reading the whole
chat again. Captured, it is one replay.

A step of n rows runs the smallest captured size B >= n. Rows past n are
padding: they write their K/V into the trash chunk and their attention output
is zeros. The attention reads the new rows as prompt rows (the prefill
kernel), one sequence whose length is device data, so one capture serves
every length up to B and every context. The recurrent layers read the rows
before the last token with the rest masked to no-ops, then the last token
alone, as a prompt whose end is a cut point is read (every prompt's is:
`checkpoints.cut_points`), and hand over the state between the two
(`kv/state.py: PadRows`, `deltanet.GatedDeltaNet.mix_padded`); with that cut,
a replay's copy of it goes to the pool's cut states as an eager step's would.

What a replay reads lives in one pinned staging buffer copied to the device
before it (ids, positions, write cells, which rows precede the last token,
and the lane's table row, start, count, state slot and last row). The logits
are the last token's. Padding changes the products' row count, so a lane's
bits here are not an eager step's (as with decode graphs on the GPU); the
answer is held to the eager one within tolerance (tests/gpu/test_prompt_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from strata.engine.graphs import capture, staging
from strata.kv.pool import KvPool
from strata.kv.state import PadRows, StatePool, prompt_states
from strata.kv.step import SeqSpec, cells_at

if TYPE_CHECKING:  # a type only: FLA's wrappers load with the capture
    from strata.models.deltanet_fla import VarlenLayout

SIZES = (8, 16, 32, 48, 64, 96, 128, 192, 256)  # padded rows of the captured prompt steps
_IDS, _POS, _CELLS, _HEAD, _ONE = range(5)  # rows of the staging buffer; _ONE holds the scalars
_LANE, _START, _N, _SLOT, _LAST = range(5)  # columns of row _ONE
META_ROWS = 5


@dataclass
class _Entry:
    size: int
    host: torch.Tensor  # [META_ROWS, size] int64, pinned
    meta: torch.Tensor  # the same on the device, read by the graph
    copied: torch.cuda.Event | None  # after the last copy out of `host` (None: not CUDA)
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [1, vocab] float32: the last token's
    layout: VarlenLayout | None = None  # the capture's own varlen layout (`PadRows.layout`), kept with it
    kept: dict = field(default_factory=dict)  # layer -> name -> the graph's state before the last token


class PromptGraphs:
    """One lane's prompt steps of a recurrent `model` over `pool` and `states` through CUDA
    graphs of `sizes` rows. The state pool needs its trash slot (warm-up and capture run on
    padding only, so nothing a lane owns is written)."""

    def __init__(self, model: torch.nn.Module, pool: KvPool, scale: float, states: StatePool,
                 sizes: tuple[int, ...] | list[int] = SIZES) -> None:
        if states.trash is None:
            raise ValueError("a captured prompt step's warm-up needs the state pool's trash slot")
        self.model = model
        self.pool = pool
        self.scale = scale
        self.states = states
        self.sizes = sorted(sizes)
        self._entries: dict[int, _Entry] = {}  # captured
        self._uncaptured: dict[int, _Entry] = {}  # `eager`'s where no graph was captured

    def supports(self, seqs: list[SeqSpec], sample: list[int]) -> bool:
        """One lane's prompt piece of at most the largest size that continues its state (not at
        position 0), sampling its last row or none, with no cut point but the one before its
        last token (where a prompt's end always has one: `checkpoints.cut_points`)."""
        if len(seqs) != 1:
            return False
        s = seqs[0]
        return (s.prompt and not s.drafted and s.cuts in ((), (s.n - 1,)) and s.start > 0
                and 0 < s.n <= self.sizes[-1] and int(sample[0]) in (0, 1))

    def size_for(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    def captured(self) -> list[int]:
        return sorted(self._entries)

    def prepare(self, rows: int) -> None:
        """Capture the graph a step of `rows` rows replays, unless it exists (CaptureFailed if
        it cannot be)."""
        self._entry(self.size_for(rows))

    @torch.inference_mode()
    def forward(self, seq: SeqSpec, tokens: list[int], sample: bool) -> torch.Tensor:
        """The last token's logits [1, vocab] (float32; valid until the next call), or [0] rows
        without `sample`; the lane's K/V and state advance by the step's tokens, and with the
        cut before the last token its state there goes to the pool's cut states (copies of the
        graph's buffers, which the next replay overwrites)."""
        e = self._entry(self.size_for(seq.n))
        self._fill(e, seq, tokens)
        assert e.graph is not None and e.logits is not None
        e.graph.replay()
        self._hand_over(seq, e.kept)
        return e.logits if sample else e.logits[:0]

    @torch.inference_mode()
    def eager(self, seq: SeqSpec, tokens: list[int]) -> torch.Tensor:
        """The same padded step without the graph (what a replay must reproduce bit for bit); on
        any device, the CPU included (Triton's interpreter runs the attention there)."""
        size = self.size_for(seq.n)
        if size not in self._entries and size not in self._uncaptured:
            self._uncaptured[size] = self._staged(size)
        e = self._entries.get(size) or self._uncaptured[size]
        self._fill(e, seq, tokens)
        kept: dict = {}
        logits = self._step(e, None, kept).clone()
        self._hand_over(seq, kept)
        return logits

    # ---- internals -----------------------------------------------------------------
    def _hand_over(self, seq: SeqSpec, kept: dict) -> None:
        """With the cut before the last token, the states there (copies: a graph's buffers are
        overwritten by its next replay) become the pool's cut states, as an eager step's do."""
        if seq.cuts:
            self.states.cut_states = {seq.lane: {seq.n - 1: {
                layer: {name: t.clone() for name, t in named.items()} for layer, named in kept.items()}}}

    def _step(self, e: _Entry, layout: VarlenLayout | None, kept: dict) -> torch.Tensor:
        """The padded step; the recurrent layers put their states before the last token in `kept`."""
        m, meta = self.model, e.meta
        one = meta[_ONE]
        pad = PadRows(meta[_HEAD] != 0, one[_LAST : _LAST + 1], layout, kept)
        from strata.attention.triton_pool import GpuTableAttention
        from strata.kernels.triton.prefill import BLOCK_M, PrefillBatch

        blocks = -(-e.size // BLOCK_M)
        prefill = PrefillBatch(torch.zeros(blocks, dtype=torch.int64, device=meta.device),
                               torch.arange(0, blocks * BLOCK_M, BLOCK_M, device=meta.device),
                               one[_LANE : _LANE + 1], one[_START : _START + 1], one[_N : _N + 1],
                               torch.zeros(1, dtype=torch.int64, device=meta.device))
        ctx = GpuTableAttention.for_prompt_graph(self.pool, meta[_CELLS], prefill, self.scale)
        h = m.embed(meta[_IDS])
        h = m.run_layers(h, meta[_POS], ctx, 0, None, states=prompt_states(self.states, one[_SLOT : _SLOT + 1], pad))
        last = h.index_select(0, one[_LAST : _LAST + 1])
        return m.compute_logits(m.norm.forward(last))

    def _fill(self, e: _Entry, seq: SeqSpec, tokens: list[int]) -> None:
        """Stage the step's rows in the pinned buffer and start its one copy to the device."""
        if e.copied is not None:
            e.copied.synchronize()  # the previous copy out of the staging buffer is done
        h = e.host.numpy()
        self._pad(h)
        n, chunk = seq.n, self.pool.chunk_size
        pos = np.arange(seq.start, seq.start + n, dtype=np.int64)
        h[_IDS, :n] = tokens
        h[_POS, :n] = pos
        h[_CELLS, :n] = cells_at(self.pool.tables.numpy(), chunk, np.full(n, seq.lane, np.int64), pos)
        h[_HEAD, : n - 1] = 1
        h[_ONE, [_LANE, _START, _N, _SLOT, _LAST]] = [seq.lane, seq.start, n, self.states.slot_of[seq.lane], n - 1]
        self.states.kept_runs = {}  # as an eager step lets the last step's runs and cuts go
        self.states.cut_states = {}
        e.meta.copy_(e.host, non_blocking=True)
        if e.copied is not None:
            e.copied.record()

    def _pad(self, h: np.ndarray) -> None:
        """Every row padding: token 0 at position 0 writing into the trash chunk, and a sequence
        of no tokens in the trash state slot."""
        h[:] = 0
        h[_CELLS] = self.pool.trash * self.pool.chunk_size
        h[_ONE, _SLOT] = self.states.trash

    def _entry(self, size: int) -> _Entry:
        if size not in self._entries:
            self._entries[size] = self._capture(size)
        return self._entries[size]

    def _staged(self, size: int) -> _Entry:
        """The buffers of a step of `size` rows, every row padding."""
        dev = self.pool.device
        host, meta = staging(META_ROWS, size, dev)
        e = _Entry(size, host, meta, torch.cuda.Event() if dev.type == "cuda" else None)
        self._pad(host.numpy())
        meta.copy_(host)
        if e.copied is not None:
            e.copied.record()
        return e

    def _capture(self, size: int) -> _Entry:
        """The graph of `size` rows, captured on padding only (CaptureFailed if it cannot be)."""
        dev = self.pool.device
        e = self._staged(size)
        from strata.models.deltanet_fla import build_layout

        e.layout = build_layout(((0, size),), dev)  # never seen by an eager step (`PadRows.layout`)
        e.graph, e.logits = capture(lambda: self._step(e, None, {}), lambda: self._step(e, e.layout, e.kept), dev)
        return e
