"""The conversation cache: parked conversations in host RAM (`--conversation-cache-mib/-slots`).

A conversation that must leave its lane is parked here (token ids plus its
K/V in the active cell format) and restored when its client comes back, so a
chat client resending the whole conversation is not read again.

Policy, in one place:
- Capacity is `make_room`'s decision alone. It drops the optional storage
  (the reuse image) first, then evicts least-recently-used entries while the
  slot count or the byte budget is exceeded. `can_fit` changes nothing.
- `bytes()` counts tensor capacities; `put` charges an entry on that basis.
- A restore (`take`) keeps the parked bytes as the reuse image, tagged with
  its conversation's tokens. A later park of that conversation, grown by a
  turn, captures only the new tokens and appends them to the image. The image
  is handed out only for the token prefix both share, so a park of another
  conversation can never pick up foreign K/V.
- There is no gate that throws the image away when the cache is full: the
  parked image replaces memory the cache already counted, and `make_room`
  already evicts the same entries or fewer than a full recapture would need.
- A recurrent model's conversation carries its saved states (`checkpoints.py`:
  its checkpoints and its state at full length). They are counted in the
  entry's bytes and go back to a lane with it; the reuse image keeps K/V only.
  Under pressure the checkpoints go first (least recently used entry first),
  before any entry is evicted; an entry keeps its state at full length.

The engine owns capturing and restoring K/V; this module only keeps tensors.
It is driven from the engine loop and is not thread-safe.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from strata.engine.checkpoints import Checkpoint
from strata.kv.formats import Storage

TOKEN_DTYPE = torch.int32
TOKEN_BYTES = 4  # per parked token id
GROWTH = 1.5  # capacity factor when an image grows by a re-park

Tokens = Sequence[int] | torch.Tensor
# capture_fn(start, end) -> per layer, run name -> [end - start, *cell shape]
CaptureFn = Callable[[int, int], list[Storage]]


def as_tokens(tokens: Tokens) -> torch.Tensor:
    """Token ids as a compact 1-D CPU tensor (cheap prefix comparisons, known size)."""
    t = torch.as_tensor(tokens, dtype=TOKEN_DTYPE, device="cpu").reshape(-1)
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading token ids `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = torch.nonzero(a[:n] != b[:n])
    return int(diff[0, 0]) if len(diff) else n


def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU holding exactly its own bytes, so its size is its true cost."""
    t = t.to("cpu")
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
        t = t.contiguous().clone()
    return t


class ParkedKV:
    """One conversation's K/V: per layer, run name -> CPU tensor [capacity, *cell shape].

    Cells are in position order and only the first `n_cells` are valid. Tensors
    are sized by capacity so a re-park appends in place; `nbytes` counts the
    capacity because that is the memory held.
    """

    def __init__(self, layers: list[Storage], n_cells: int | None = None) -> None:
        self._layers: list[Storage] = [{k: _owned(t) for k, t in s.items()} for s in layers]
        caps = {len(t) for s in self._layers for t in s.values()}
        if len(caps) > 1:
            raise ValueError(f"parked K/V runs have different cell counts: {sorted(caps)}")
        self._capacity = caps.pop() if caps else 0
        self.n_cells = self._capacity if n_cells is None else n_cells
        if not 0 <= self.n_cells <= self._capacity:
            raise ValueError(f"n_cells {self.n_cells} outside capacity {self._capacity}")

    @property
    def capacity(self) -> int:
        return self._capacity

    def cell_bytes(self) -> int:
        """Bytes of one cell over every layer and run."""
        tensors = [t for s in self._layers for t in s.values()]
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in tensors)

    def nbytes(self) -> int:
        return sum(t.nbytes for s in self._layers for t in s.values())

    def capacity_for(self, n_cells: int) -> int:
        """Capacity after making room for `n_cells` cells (grows geometrically)."""
        if n_cells <= self._capacity:
            return self._capacity
        return max(n_cells, math.ceil(self._capacity * GROWTH))

    def nbytes_for(self, n_cells: int) -> int:
        """True size once `n_cells` cells are held: what a park must make room for."""
        return self.capacity_for(n_cells) * self.cell_bytes()

    def layer(self, i: int) -> Storage:
        """Layer `i`'s valid cells (views, not copies)."""
        return {k: t[: self.n_cells] for k, t in self._layers[i].items()}

    def layers(self) -> list[Storage]:
        return [self.layer(i) for i in range(len(self._layers))]

    def view(self) -> ParkedKV:
        """Another handle on the same tensors with its own cell count."""
        out = ParkedKV.__new__(ParkedKV)
        out._layers = [dict(s) for s in self._layers]  # growth replaces tensors in one handle only
        out._capacity, out.n_cells = self._capacity, self.n_cells
        return out

    def truncate(self, n_cells: int) -> None:
        """Keep the first `n_cells` cells (the capacity stays)."""
        if not 0 <= n_cells <= self.n_cells:
            raise ValueError(f"cannot truncate {self.n_cells} cells to {n_cells}")
        self.n_cells = n_cells

    def append(self, new: list[Storage]) -> None:
        """Add cells after the valid ones, growing the capacity geometrically if needed."""
        if len(new) != len(self._layers):
            raise ValueError(f"appending {len(new)} layers to parked K/V of {len(self._layers)}")
        counts = {len(t) for s in new for t in s.values()}
        if len(counts) > 1:
            raise ValueError(f"appended runs have different cell counts: {sorted(counts)}")
        k = counts.pop() if counts else 0
        end = self.n_cells + k
        cap = self.capacity_for(end)
        for old, add in zip(self._layers, new):
            if old.keys() != add.keys():
                raise ValueError(f"appended runs {sorted(add)} differ from parked {sorted(old)}")
            for name, t in old.items():
                a = add[name]
                if a.dtype != t.dtype or a.shape[1:] != t.shape[1:]:
                    raise ValueError(f"run {name!r}: appended {a.dtype} {tuple(a.shape[1:])} "
                                     f"differs from parked {t.dtype} {tuple(t.shape[1:])}")
                if cap != self._capacity:
                    grown = torch.empty((cap, *t.shape[1:]), dtype=t.dtype)
                    grown[: self.n_cells] = t[: self.n_cells]
                    old[name] = t = grown
                t[self.n_cells : end] = a
        self._capacity, self.n_cells = cap, end


@dataclass
class ParkedEntry:
    """A parked conversation: what the engine restores into a lane's cells."""

    entry_id: int
    tokens: torch.Tensor  # int32 [n]
    kv: ParkedKV
    states: list[Checkpoint] = field(default_factory=list)  # a recurrent model's, by position

    def nbytes(self) -> int:
        return self.kv.nbytes() + self.tokens.nbytes + states_bytes(self.states)


def states_bytes(states: Sequence[Checkpoint]) -> int:
    return sum(c.nbytes for c in states)


@dataclass
class ReuseImage:
    """The bytes of the last restored conversation, tagged with that conversation's tokens."""

    tokens: torch.Tensor
    kv: ParkedKV

    def nbytes(self) -> int:
        return self.kv.nbytes() + self.tokens.nbytes


@dataclass
class CacheStats:
    entries: int
    bytes: int
    budget_bytes: int
    slots: int
    reuse_bytes: int
    hits: int
    misses: int
    restores: int
    incremental_parks: int
    full_parks: int
    skipped_parks: int
    evictions: int
    superseded: int
    reuse_drops: int
    shed_checkpoints: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ConversationCache:
    """Parked conversations, LRU by slots and bytes, plus at most one reuse image."""

    def __init__(self, budget_bytes: int, slots: int, min_prefix: int = 1) -> None:
        if budget_bytes < 0 or slots < 1 or min_prefix < 1:
            raise ValueError("conversation cache needs budget_bytes >= 0, slots >= 1, "
                             "min_prefix >= 1")
        self.budget_bytes = budget_bytes
        self.slots = slots
        self.min_prefix = min_prefix
        self._entries: OrderedDict[int, ParkedEntry] = OrderedDict()  # least recently used first
        self._reuse: ReuseImage | None = None
        self._next_id = 1
        self._bytes = 0
        self.hits = self.misses = self.restores = 0
        self.incremental_parks = self.full_parks = self.skipped_parks = 0
        self.evictions = self.superseded = self.reuse_drops = 0
        self.shed_checkpoints = 0  # entries whose checkpoints went to make room

    # ----- figures -----
    def bytes(self) -> int:
        """Bytes held: every entry's tensors at capacity, plus the reuse image."""
        return self._bytes + (self._reuse.nbytes() if self._reuse else 0)

    def __len__(self) -> int:
        return len(self._entries)

    def entry_ids(self) -> list[int]:
        """Entry ids, least recently used first."""
        return list(self._entries)

    def entry(self, entry_id: int) -> ParkedEntry:
        """A parked entry, read-only and without marking it used (metrics, saving to a file)."""
        return self._entries[entry_id]

    @property
    def reuse_image(self) -> ReuseImage | None:
        return self._reuse

    def stats(self) -> CacheStats:
        reuse = self._reuse.nbytes() if self._reuse else 0
        return CacheStats(
            len(self._entries), self.bytes(), self.budget_bytes, self.slots, reuse, self.hits,
            self.misses, self.restores, self.incremental_parks, self.full_parks, self.skipped_parks,
            self.evictions, self.superseded, self.reuse_drops, self.shed_checkpoints)

    # ----- finding and restoring -----
    def lookup(self, tokens: Tokens) -> tuple[int, int] | None:
        """(entry_id, shared prefix length) of the entry sharing the most leading tokens.

        Ties go to the most recently used entry. A hit marks the entry used.
        """
        toks = as_tokens(tokens)
        best: tuple[int, int] | None = None
        for eid, entry in reversed(self._entries.items()):
            n = common_prefix(toks, entry.tokens)
            if n >= self.min_prefix and (best is None or n > best[1]):
                best = (eid, n)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best[0])
        return best

    def take(self, entry_id: int) -> ParkedEntry:
        """Remove an entry for restore; its bytes stay as the reuse image.

        The returned K/V shares tensors with the image: restore from it before
        the next park, which may append to (and overwrite past the shared
        prefix of) those tensors.
        """
        entry = self._entries.pop(entry_id)
        self._bytes -= entry.nbytes()
        self.drop_reuse()
        self._reuse = ReuseImage(entry.tokens, entry.kv.view())
        self.restores += 1
        return entry

    def borrow(self, entry_id: int) -> ParkedEntry:
        """An entry to restore from while it stays parked (a request sharing only a prefix).

        The caller copies what it needs and must not modify the tensors.
        """
        entry = self._entries[entry_id]
        self._entries.move_to_end(entry_id)
        self.restores += 1
        return entry

    def reuse_for(self, tokens: Tokens) -> tuple[ReuseImage | None, int]:
        """The reuse image and how many leading tokens of `tokens` its K/V is valid for.

        Only the prefix both share is valid: (None, 0) when they share nothing.
        """
        if self._reuse is None:
            return None, 0
        n = common_prefix(as_tokens(tokens), self._reuse.tokens[: self._reuse.kv.n_cells])
        return (self._reuse, n) if n > 0 else (None, 0)

    def drop_reuse(self) -> None:
        """Forget the reuse image (e.g. when its conversation ends for good)."""
        if self._reuse is not None:
            self._reuse = None
            self.reuse_drops += 1

    # ----- capacity -----
    @staticmethod
    def estimate_bytes(n_tokens: int, bytes_per_token: int) -> int:
        """True size of a freshly captured entry: `bytes_per_token` is K/V over all layers."""
        return n_tokens * (bytes_per_token + TOKEN_BYTES)

    def can_fit(self, incoming_bytes: int, held_bytes: int = 0) -> bool:
        """Whether an entry of `incoming_bytes` fits now, without dropping or evicting
        anything. A pure query: parking does not need it (make_room decides)."""
        limit = self.budget_bytes - held_bytes - incoming_bytes
        return len(self._entries) < self.slots and self.bytes() <= limit

    def make_room(self, incoming_bytes: int, held_bytes: int = 0) -> bool:
        """Free space for an entry of `incoming_bytes` while `held_bytes` are used elsewhere.

        Drops the reuse image first, then evicts LRU entries. When the entry
        could not fit even in an empty cache, nothing is dropped.
        """
        limit = self.budget_bytes - held_bytes - incoming_bytes
        if limit < 0:
            return False
        if self._reuse is not None and self.bytes() > limit:
            self.drop_reuse()
        for entry in list(self._entries.values()):
            if self.bytes() <= limit:  # (checkpoints free bytes, not slots)
                break
            if len(entry.states) > 1:  # keep the state at the end: the conversation's own
                shed = states_bytes(entry.states[:-1])
                entry.states = entry.states[-1:]
                self._bytes -= shed
                self.shed_checkpoints += 1
        while self._entries and (len(self._entries) >= self.slots or self.bytes() > limit):
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes()
            self.evictions += 1
        return len(self._entries) < self.slots and self.bytes() <= limit

    def put(self, tokens: Tokens, kv: ParkedKV, states: Sequence[Checkpoint] = ()) -> int:
        """Park a conversation (after `make_room`); returns its entry id.

        Charges the entry's true size. Entries whose tokens are a prefix of the
        new tokens are superseded (the new entry holds the same K/V and more).
        """
        toks = as_tokens(tokens)
        if kv.n_cells != len(toks):
            raise ValueError(f"parking {len(toks)} tokens with {kv.n_cells} cells of K/V")
        for eid in [e for e, x in self._entries.items() if x.tokens.equal(toks[: len(x.tokens)])]:
            self._bytes -= self._entries.pop(eid).nbytes()
            self.superseded += 1
        entry = ParkedEntry(self._next_id, toks, kv, list(states))
        self._next_id += 1
        self._entries[entry.entry_id] = entry
        self._bytes += entry.nbytes()
        return entry.entry_id

    def park(
        self,
        tokens: Tokens,
        capture_fn: CaptureFn,
        bytes_per_token: int,
        held_bytes: int = 0,
        states: Sequence[Checkpoint] = (),
    ) -> int | None:
        """Park a lane's conversation, capturing only what the reuse image lacks.

        `capture_fn(start, end)` returns the K/V of positions [start, end) per
        layer; `states` are a recurrent model's saved states of it. Returns the
        entry id, or None when it cannot fit (not parked; the conversation's
        reuse image is then gone too).
        """
        toks = as_tokens(tokens)
        n = len(toks)
        extra = states_bytes(states)
        image, shared = self.reuse_for(toks)
        if image is not None:
            # The image becomes this entry: it stops counting as optional storage,
            # and the room asked for is its true size after growth (never capped).
            self._reuse = None
            kv = image.kv
            kv.truncate(shared)
            incoming = kv.nbytes_for(n) + toks.nbytes + extra
        else:
            incoming = self.estimate_bytes(n, bytes_per_token) + extra
        if not self.make_room(incoming, held_bytes):
            self.skipped_parks += 1
            return None
        if image is not None:
            if kv.n_cells < n:
                kv.append(capture_fn(kv.n_cells, n))
            self.incremental_parks += 1
        else:
            kv = ParkedKV(capture_fn(0, n))
            self.full_parks += 1
        true_size = kv.nbytes() + toks.nbytes + extra
        if true_size > incoming and not self.make_room(true_size, held_bytes):
            self.skipped_parks += 1  # capture_fn gave more than bytes_per_token promised
            return None
        return self.put(toks, kv, states)
