"""CUDA graphs of the model's decode step, captured per padded lane count and replayed.

An eager decode step of an 8B model launches over a thousand kernels, and
their Python and launch cost, not the GPU, sets the pace. A captured step
is replayed with one call. What changes between steps lives in fixed device
buffers refilled before each replay (token ids, positions, lanes,
lengths, write cells, in one host-to-device copy); the chunk tables are read
from the pool's fixed device copy, so moves and reservations need no
re-capture. Prompt reading stays eager (a recurrent model's short one-lane
prompt steps excepted: prompt_graphs.py).

A step of n lanes runs the smallest captured size >= n; padding lanes read
one cell of lane 0 and write into the trash chunk, so they touch nothing
anyone owns. Graphs are captured on first use of a size.

A stage of a layer split captures its part of the step (`layers`): the
first stage embeds the ids, a later one reads the hidden states the stage
before it left (copied into a fixed input buffer), and only the last part
(`head`: the final norm and the logits) makes logits; the others leave
hidden states. The unsplit model is one part that does all three.

A recurrent model (Qwen3-Next's DeltaNet layers) captures too: each lane's
slot in the state pool is one more metadata row, the layers gather and
scatter the states through it on the device (`kv/state.py: decode_states`),
and padding rows use the pool's trash slot. Such a graph takes decode rows
only: a run of drafts is computed row after row from one state, which a
graph of independent rows cannot do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from strata.kv.pool import KvPool
from strata.kv.state import StatePool, decode_states
from strata.kv.step import SeqSpec, cells_at, decode_step

if TYPE_CHECKING:  # the kernels need Triton; staging (host work) does not
    from strata.attention.triton_pool import GpuTableAttention

# Padded lane counts: powers of two, then steps of 16 (a decode step's cost grows slowly with lanes).
SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_IDS, _POS, _ROWS, _LANE, _LENS, _CELLS, _SLOT = range(7)
META_ROWS = 7  # rows of a step's staged metadata, as above


class CaptureFailed(RuntimeError):
    """A decode step could not be captured (or its warm-up failed): the runner steps eagerly."""


@dataclass
class _Entry:
    size: int
    host: torch.Tensor  # [META_ROWS, size] int64, pinned: staged metadata
    meta: torch.Tensor  # [META_ROWS, size] int64 on the device, read by the graph
    ctx: GpuTableAttention
    copied: torch.cuda.Event
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output: [size, vocab] float32 logits, or hidden
    input: torch.Tensor | None = None  # [size, hidden]: a part that does not embed reads it
    filled: int = 0  # lanes the staging buffer holds: the columns past them are padding


class DecodeGraphs:
    """Decode steps of `model` (or of its layers `layers`) over `pool` through captured CUDA graphs.

    `embed`: the part starts from token ids (else from `hidden` given to `forward`); `head`: it
    ends with the final norm and the logits (else it returns hidden states); `rope`: the RoPE
    tables on the pool's device where they are not the model's own; `states`: a recurrent
    model's state pool (its layers read and write their lanes' slots in the graph), which needs
    its trash slot; its graphs hold decode rows only, so `rows_per_lane` is then 1 (drafts are
    verified eagerly: `step_rows`).
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, scale: float, layers: range | None = None,
                 embed: bool = True, head: bool = True,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None, rows_per_lane: int = 1,
                 states: StatePool | None = None) -> None:
        self.model = model
        self.pool = pool
        self.scale = scale
        self.layers = layers  # None: all of them
        self.embed = embed
        self.head = head
        self.rope = rope
        if states is not None and states.trash is None:
            raise ValueError("a captured step's padding rows need the state pool's trash slot")
        self.states = states
        if states is not None:
            rows_per_lane = 1  # decode rows only (`step_rows`)
        most = pool.num_lanes * rows_per_lane  # rows_per_lane > 1: drafts verified as rows (`rows_of`)
        self.sizes = [s for s in SIZES if s < most] + [most]
        self._entries: dict[int, _Entry] = {}

    def supports(self, seqs: list[SeqSpec], sample: list[int]) -> bool:
        """A pure decode step whose every lane is sampled (what the graph computes); with
        states, none of them at position 0 (a lane's state starts from zeros there)."""
        return (decode_step(seqs) and len(seqs) <= self.sizes[-1] and all(sample)
                and (self.states is None or all(s.start > 0 for s in seqs)))

    def step_rows(self, seqs: list[SeqSpec], sample: list[int]) -> list[SeqSpec] | None:
        """`rows_of` for this graph's model: a recurrent model's run of drafts is not such rows
        (each row continues the state the row before left), so a step with one gives None."""
        if self.states is not None and any(s.n > 1 for s in seqs):
            return None
        return self.rows_of(seqs, sample)

    @staticmethod
    def rows_of(seqs: list[SeqSpec], sample: list[int]) -> list[SeqSpec] | None:
        """A step of decode lanes and verified drafts as one-token rows, or None if a run is not
        sampled in full. Row j of a lane's run attends over the cells rows 0..j-1 wrote in the same
        layer (every write of a layer precedes its attention), so the decode graph computes a
        drafted run as it computes the same tokens decoded one step at a time."""
        if any(int(w) != s.n or s.prompt for s, w in zip(seqs, sample)):
            return None
        return [SeqSpec(s.lane, s.start + j, 1) for s in seqs for j in range(s.n)]

    def captured(self) -> list[int]:
        """The padded lane counts captured so far."""
        return sorted(self._entries)

    def size_for(self, lanes: int) -> int:
        return next(s for s in self.sizes if s >= lanes)

    def prepare(self, lanes: int) -> None:
        """Capture the graph a step of `lanes` lanes replays, unless it exists (CaptureFailed if
        it cannot be: nothing a lane owns was written, since the warm-up and the capture run on
        padding rows only)."""
        self._entry(self.size_for(lanes))

    @torch.inference_mode()
    def forward(self, seqs: list[SeqSpec], tokens: list[int],
                device_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(seqs), vocab] (float32) of one decode step, or the part's hidden states;
        valid until the next call.

        `device_ids` (int64 on the device) replace `tokens`: the previous
        step's samples, used without a round trip through the host. `hidden`:
        the previous part's output, for a part that does not embed.
        """
        entry = self._entry(self.size_for(len(seqs)))
        self._fill(entry, seqs, tokens)
        if device_ids is not None:
            entry.meta[_IDS, : len(seqs)].copy_(device_ids)
        if hidden is not None:
            assert entry.input is not None
            entry.input[: len(seqs)].copy_(hidden)
        assert entry.graph is not None and entry.logits is not None
        entry.graph.replay()
        return entry.logits[: len(seqs)]

    @torch.inference_mode()
    def eager(self, seqs: list[SeqSpec], tokens: list[int], hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The same padded step without the graph (what the graph must reproduce bit for bit)."""
        entry = self._entry(self.size_for(len(seqs)))
        self._fill(entry, seqs, tokens)
        if hidden is not None:
            assert entry.input is not None
            entry.input[: len(seqs)].copy_(hidden)
        return self._step(entry)[: len(seqs)].clone()

    # ---- internals -----------------------------------------------------------------
    def _step(self, e: _Entry) -> torch.Tensor:
        m = self.model
        h = m.embed(e.meta[_IDS]) if self.embed else e.input
        start, stop = (0, None) if self.layers is None else (self.layers.start, self.layers.stop)
        states = None if self.states is None else decode_states(self.states, e.meta[_SLOT])
        h = m.run_layers(h, e.meta[_POS], e.ctx, start, stop, rope=self.rope, states=states)
        return m.compute_logits(m.norm.forward(h)) if self.head else h

    def _fill(self, e: _Entry, seqs: list[SeqSpec], tokens: list[int]) -> None:
        """Stage the step's metadata in the pinned buffer and start its one copy to the device.

        numpy on the pinned buffer's memory: a step's host work is a few
        microseconds of array writes, where torch's small CPU ops cost
        several each.
        """
        e.copied.synchronize()  # the previous copy out of the staging buffer is done
        n, chunk = len(seqs), self.pool.chunk_size
        h = e.host.numpy()
        lane_ids = np.fromiter((s.lane for s in seqs), np.int64, n)
        pos = np.fromiter((s.start for s in seqs), np.int64, n)
        h[_IDS, :n] = tokens
        h[_POS, :n] = pos
        h[_LANE, :n] = lane_ids
        h[_LENS, :n] = pos + 1
        h[_CELLS, :n] = cells_at(self.pool.tables.numpy(), chunk, lane_ids, pos)
        if self.states is not None:
            h[_SLOT, :n] = [self.states.slot_of[lane] for lane in lane_ids.tolist()]
            self.states.kept_runs = {}  # as an eager step lets the last step's runs go
        if e.filled > n:  # lanes of a larger step before: padding again
            self._pad(h, n, e.filled)
        e.filled = n
        e.meta.copy_(e.host, non_blocking=True)
        e.copied.record()

    def _pad(self, h: np.ndarray, start: int, stop: int) -> None:
        h[_IDS, start:stop] = 0
        h[_POS, start:stop] = 0
        h[_LANE, start:stop] = 0
        h[_LENS, start:stop] = 1
        h[_CELLS, start:stop] = self.pool.trash * self.pool.chunk_size
        if self.states is not None:
            h[_SLOT, start:stop] = self.states.trash

    def dtype(self) -> torch.dtype:
        """The hidden states' dtype: the part's first weights'."""
        first = self.layers.start if self.layers is not None else 0
        part = self.model.layers[first] if first < len(self.model.layers) else self.model.norm  # a head
        return next(part.parameters()).dtype

    def _entry(self, size: int) -> _Entry:
        e = self._entries.get(size)
        if e is not None:
            return e
        dev = self.pool.device
        host, meta = staging(META_ROWS, size, dev)
        host[_ROWS] = torch.arange(size)
        from strata.attention.triton_pool import GpuTableAttention

        ctx = GpuTableAttention.for_graph(self.pool, meta[_ROWS:_SLOT], self.scale)
        e = _Entry(size, host, meta, ctx, torch.cuda.Event())
        if not self.embed:
            cfg = self.model.config
            e.input = torch.zeros((size, cfg.hidden_size), dtype=self.dtype(), device=dev)
        e.copied.record()
        self._pad(host.numpy(), 0, size)
        meta.copy_(host)
        step = lambda: self._step(e)  # noqa: E731
        e.graph, e.logits = capture(step, step, dev)
        self._entries[size] = e
        return e


def staging(rows: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's metadata buffer: [rows, size] int64 in host memory (pinned for a CUDA device),
    and its device copy."""
    host = torch.zeros((rows, size), dtype=torch.int64)
    return (host.pin_memory() if device.type == "cuda" else host,
            torch.zeros((rows, size), dtype=torch.int64, device=device))


def capture(warm: Callable[[], torch.Tensor], step: Callable[[], torch.Tensor],
            device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of `step` and its output tensor, after two runs of `warm` on a side stream
    (kernel compiles and autotuning, library handles: what cannot happen inside a capture).
    Any failure raises CaptureFailed: the caller's steps then run eagerly."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            for _ in range(2):
                warm()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    except Exception as err:  # noqa: BLE001 - any failure: the step runs eagerly instead
        torch.cuda.current_stream(device).wait_stream(side)
        raise CaptureFailed(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
    return graph, out
