"""The expert cache (`--expert-cache N`): every expert in host RAM, the hot ones in device slots.

A MoE model's experts are most of its bytes (Qwen3-30B-A3B: 29 of 30.5 B
parameters) while a token reads k of E per layer, so the experts follow the
routing the way K/V cells follow the tokens: all of them in pinned host
memory, N slots per layer on the device. A step's routing is known before
its experts run; experts it needs that are not resident are copied into the
slots of experts it does not need (`kv/expert_residency.py` orders the
victims), on a copy stream; a step that needs more experts than there are
slots runs in rounds of at most N, each round's products beside the next
round's copies. The products are the same kernels reading the slots instead
of the full tensors, with the full layer's launch shapes, every (token, expert) row computed on its own and the k rows
summed in expert order (`moe.combine_ordered`), so the cache gives the bits
of all experts resident whatever it holds (tested with one slot). The
routing costs one device-to-host read per layer and step, so a cached model
decodes without CUDA graphs (docs/MOE.md measures what that costs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from strata.errors import BadRequest
from strata.kv.expert_residency import DEFAULT_POLICY, ExpertUsage, evict_order
from strata.models.expert_refill import ExpertRefill
from strata.models.moe import ExpertMath

DEFAULT_MAPPED_UPLOADS = 2  # experts a layer copies into its slots per step with mapped reads
Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x -> (expert ids, weights)


@dataclass
class CacheStats:
    """Counters over every layer's cache (what /metrics and /v1/state report)."""

    hits: int = 0
    misses: int = 0
    host_computed: int = 0  # misses past the upload cap, computed on the host (part of misses)
    prefetched: int = 0  # experts copied in ahead of their layer (`--expert-prefetch`)
    prefetch_used: int = 0  # of those, the ones their layer's routing then took
    bytes_uploaded: int = 0
    mapped_reads: int = 0  # misses read in place from host memory (`--expert-misses mapped`)
    token_layers: int = 0  # tokens through each cached layer, summed
    slots: dict[int, int] = field(default_factory=dict)  # layer -> slots

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def figures(self) -> dict[str, object]:
        """The counters as /v1/state shows them (bytes per token: uploads over tokens through
        the model)."""
        tokens = self.token_layers / max(1, len(self.slots))
        return {"hit_rate": self.hit_rate(), "hits": self.hits, "misses": self.misses,
                "host_computed": self.host_computed, "prefetched": self.prefetched,
                "prefetch_used": self.prefetch_used, "mapped_reads": self.mapped_reads,
                "bytes_uploaded": self.bytes_uploaded,
                "bytes_per_token": self.bytes_uploaded / tokens if tokens else 0.0,
                "slots_per_layer": min(self.slots.values(), default=0), "layers": len(self.slots)}


class ExpertCache(nn.Module):
    """One layer's experts: host tensors [E, ...] and device slots [N, ...] of the same rows.

    `math`: the holder's product functions (`moe.DenseMath` / `BlockMath`), called with the slot
    tensors; `host`: the holder's expert-major tensors (moved to pinned memory here).
    `max_uploads`: experts copied in per step at most (None: every miss); the misses past it,
    those with the fewest tokens, are computed on the host from the host tensors, with the
    host's kernels (their rounding, not the device's), while the device computes the rest.
    `look_ahead`: predict the next sparse layer's experts from this layer's input and copy them
    into its slots while this layer computes (`prefetch`).
    `fused`: the fused kernels take these experts (what mapped reads need: `attach`).
    """

    def __init__(self, math: ExpertMath, host: list[torch.Tensor], slots: int, device: torch.device,
                 layer: int, stats: CacheStats, policy: str = DEFAULT_POLICY,
                 max_uploads: int | None = None, fused: bool = False) -> None:
        super().__init__()
        experts = int(host[0].shape[0])
        if not 1 <= slots <= experts:
            raise ValueError(f"an expert cache of {slots} slots for {experts} experts")
        if max_uploads is not None and max_uploads < 0:
            raise ValueError(f"an upload cap of {max_uploads} experts")
        if max_uploads is not None and getattr(math, "packed", False):
            raise BadRequest("--expert-uploads: these experts are GGUF blocks packed for the GPU's kernels, "
                             "which the host's cannot read; use --weights dense, or no cap", "expert_uploads")
        self.math = math
        self.num_experts = experts
        self.num_slots = slots
        self.max_uploads = max_uploads
        self.policy = policy
        self.stats = stats
        stats.slots[layer] = slots
        pin = device.type == "cuda"
        for i, t in enumerate(host):
            t = t.detach().cpu().contiguous()
            self.register_buffer(f"host{i}", t.pin_memory() if pin else t)
            self.register_buffer(f"slot{i}", torch.empty((slots, *t.shape[1:]), dtype=t.dtype, device=device))
        self.parts = len(host)
        self.expert_bytes = one_expert_bytes(host)
        self.slot_of = [-1] * experts  # expert -> slot
        self.held: list[int] = [-1] * slots  # slot -> expert
        self.usage = ExpertUsage(experts)
        self.copies = torch.cuda.Stream(device) if pin else None
        # expert -> slot on the device, filled from a pinned host copy without a stall: the host
        # copy changes again only after the next step's routing read, which waits for this copy
        self.table_host = torch.full((experts,), -1, dtype=torch.int64, pin_memory=pin)
        self.table = torch.full((experts,), -1, dtype=torch.int64, device=device)
        self.trace: list[list[int]] | None = None  # each step's experts, once `record` is called
        self.ahead: tuple[Route, ExpertCache] | None = None  # `look_ahead`
        self.fetched: set[int] = set()  # experts `prefetch` copied in for the coming step
        self.ready: torch.cuda.Event | None = None  # when those copies are done (the copy stream)
        self.fused = fused
        self.refill: ExpertRefill | None = None  # mapped reads (`attach`)
        self.index = -1  # this layer's row in the refill's logs and tables
        self.log: torch.Tensor | None = None  # the device row mapped steps write their routing to

    def attach(self, refill: ExpertRefill, index: int, log: torch.Tensor, table: torch.Tensor) -> None:
        """Read misses in place from now on (`expert_refill.py`): steps the refill `takes` log their
        routing into `log` and read each expert from its slot or host copy by `table` (this
        layer's rows of the refill's buffers, which replace the cache's own table)."""
        if not self.fused:
            raise BadRequest("--expert-misses mapped: the fused kernels do not take these experts "
                             "(CUDA, bf16 / fp16 / fp32 or the block types of --weights gguf)", "expert_misses")
        if self.max_uploads is not None or self.ahead is not None:
            raise BadRequest("--expert-misses mapped copies between steps: it takes neither a host "
                             "compute cap (--expert-uploads sets its copies a step) nor --expert-prefetch",
                             "expert_misses")
        self.refill, self.index, self.log, self.table = refill, index, log, table

    @property
    def graph_safe(self) -> bool:
        """Mapped reads decide nothing on the host, so their steps can be captured."""
        return self.refill is not None and self.fused

    def look_ahead(self, route: Route, cache: ExpertCache) -> None:
        """Prefetch for the next sparse layer: its router (`route`, x -> (ids, weights)) applied to
        this layer's input predicts its experts (the residual stream changes little from one
        layer to the next), read with this layer's routing in one transfer; the predicted
        experts `cache` lacks are copied in while this layer computes."""
        self.ahead = (route, cache)

    def record(self) -> list[list[int]]:
        """Start keeping the experts of every step from now on (the routing traces the policies
        are compared on, `benchmarks/expert_policy.py`); returns the list that fills."""
        self.trace = []
        return self.trace

    def host_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f"host{i}") for i in range(self.parts)]

    def slot_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f"slot{i}") for i in range(self.parts)]

    def resident(self) -> list[int]:
        return [e for e in self.held if e >= 0]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.refill is None:
            return self._copied(x, ids, weights)
        if self.refill.takes(int(x.shape[0])):
            return self._mapped(x, ids, weights)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a captured step of {x.shape[0]} rows: mapped expert reads take at most "
                               f"{self.refill.rows} (the copy path reads the routing on the host)")
        self.refill.settle()
        y = self._copied(x, ids, weights)
        self.refill.publish(self.index)
        return y

    def _mapped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert read from its slot or its host copy, by the table (no host read)."""
        assert self.log is not None and self.refill is not None
        ids = self.refill.unpadded(ids)
        self.log[: ids.numel()].copy_(ids.reshape(-1))
        launch = self.math.config(self.host_tensors(), int(x.shape[0]), int(ids.shape[1]), x.dtype)  # all E's
        return self.math.mapped(x, self.slot_tensors(), self.host_tensors(), self.table, ids, weights, launch)

    def _copied(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The step's missing experts copied in first (its routing read on the host)."""
        flat, predicted = self._routing(x, ids)
        need = sorted(set(flat))
        if self.trace is not None:
            self.trace.append(need)
        if self.ready is not None:  # the slots `prefetch` filled are read below
            torch.cuda.current_stream(x.device).wait_event(self.ready)
            self.ready = None
        self.stats.prefetch_used += len(self.fetched.intersection(need))
        self.fetched = set()
        hits = [e for e in need if self.slot_of[e] >= 0]
        misses = [e for e in need if self.slot_of[e] < 0]
        self.stats.hits += len(hits)
        self.stats.misses += len(misses)
        self.stats.token_layers += int(x.shape[0])
        misses, on_host = uploads_and_host(misses, flat, self.max_uploads)
        k = ids.shape[1]
        launch = self.math.config(self.host_tensors(), int(x.shape[0]), k, x.dtype)  # all E's
        start = torch.cuda.current_stream(x.device).record_event() if self.copies is not None else None
        if on_host:
            y = torch.empty((ids.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
            rows, pairs, experts = self._host_rows(x, flat, k, on_host)  # before the device's work
            self._rounds(x, ids, hits, misses, [e for e in need if e not in on_host], y, launch, start)
            self._compute_host(rows, pairs, experts, y)  # on the host while the device runs its part
            self.stats.host_computed += len(on_host)
        elif len(need) <= self.num_slots:  # one pass: the misses copied in, then every pair at once
            self._upload(misses, set(need), start)
            self.table_host.copy_(torch.tensor(self.slot_of, dtype=torch.int64))
            self.table.copy_(self.table_host, non_blocking=True)
            slots = self.table[ids.reshape(-1)]
            rows = x if k == 1 else x.repeat_interleave(k, dim=0)
            y = self.math.pairs(rows, self.slot_tensors(), slots, launch)
        else:  # rounds of at most N experts: what is resident first, beside the first copies
            y = torch.empty((ids.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
            self._rounds(x, ids, hits, misses, need, y, launch, start)
        self.usage.record(need)
        if self.ahead is not None:  # after this layer's own copies, beside its products
            self.ahead[1].prefetch(predicted)
        return self.math.combine(y, ids, weights)

    def _routing(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """This step's routing on the host (its one device-to-host read) and, with `look_ahead`,
        the next sparse layer's experts as predicted from x, read in the same transfer."""
        if self.ahead is None:
            return ids.reshape(-1).tolist(), []
        guess, _ = self.ahead[0](x)
        both = torch.cat([ids.reshape(-1), guess.reshape(-1)]).tolist()
        return both[: ids.numel()], sorted(set(both[ids.numel():]))

    def prefetch(self, experts: list[int]) -> None:
        """Copy in the predicted `experts` this layer lacks, evicting by the policy as a step
        would (never one of `experts`), at most what the upload cap and the slots allow; the
        next forward waits for the copies before it reads a slot. Only what is resident
        changes, never a product, so the bits stay all-resident's."""
        held = sum(self.slot_of[e] >= 0 for e in experts)
        room = self.num_slots - held if self.max_uploads is None else min(self.max_uploads, self.num_slots - held)
        want = [e for e in experts if self.slot_of[e] < 0][: max(0, room)]
        if not want:
            return
        start = torch.cuda.current_stream(self.table.device).record_event() if self.copies is not None else None
        self.ready = self._upload(want, set(experts), start, join=False)
        self.fetched.update(want)
        self.stats.prefetched += len(want)

    def _rounds(self, x: torch.Tensor, ids: torch.Tensor, hits: list[int], misses: list[int],
                need: list[int], y: torch.Tensor, launch: object, start: torch.cuda.Event | None) -> None:
        """y's rows of the pairs of `hits` and `misses`, in rounds of at most N experts."""
        room = self.num_slots - len(hits)
        self._compute(x, ids, hits, y, launch)  # overlaps the copies of the first misses, which
        self._upload(misses[:room], set(need), start)  # only wait for the steps before this one
        self._compute(x, ids, misses[:room], y, launch)
        for at in range(room, len(misses), self.num_slots):  # evicts experts computed above
            group = misses[at : at + self.num_slots]
            after = torch.cuda.current_stream(x.device).record_event() if self.copies is not None else None
            self._upload(group, set(group), after)
            self._compute(x, ids, group, y, launch)

    @staticmethod
    def _host_rows(x: torch.Tensor, flat: list[int], k: int,
                   experts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, expert) pairs of `experts` from the routing read (`flat`, host): their x
        rows copied to the host (this waits for x only), the pairs and their experts (host)."""
        chosen = set(experts)
        pairs = [i for i, e in enumerate(flat) if e in chosen]
        tokens = torch.tensor([i // k for i in pairs], dtype=torch.int64)
        rows = x.index_select(0, tokens.to(x.device)).cpu()
        return rows, torch.tensor(pairs, dtype=torch.int64), torch.tensor([flat[i] for i in pairs])

    def _compute_host(self, rows: torch.Tensor, pairs: torch.Tensor, experts: torch.Tensor, y: torch.Tensor) -> None:
        """y's rows of `pairs`, computed on the host from the host tensors (the host's kernels)."""
        out = self.math.pairs(rows, self.host_tensors(), experts, None)
        if y.is_cuda:
            y[pairs.to(y.device)] = out.pin_memory().to(y.device, non_blocking=True)
        else:
            y[pairs] = out

    def _upload(self, experts: list[int], needed: set[int], after: torch.cuda.Event | None,
                join: bool = True) -> torch.cuda.Event | None:
        """Copy `experts` into slots that hold nothing or an expert outside `needed`, on the copy
        stream once the compute stream has passed `after` (the last reads of those slots); the
        compute stream then waits for the copies (join), or the event of their end is returned."""
        if not experts:
            return None
        free = [s for s, e in enumerate(self.held) if e < 0]
        victims = evict_order(self.usage, self.resident(), needed, self.policy)
        slots = free + [self.slot_of[e] for e in victims]
        assert len(slots) >= len(experts), "the rounds leave a slot for every miss"
        stream = self.copies
        if stream is not None and after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for e, s in zip(experts, slots, strict=False):
                old = self.held[s]
                if old >= 0:
                    self.slot_of[old] = -1
                for src, dst in zip(self.host_tensors(), self.slot_tensors(), strict=True):
                    dst[s].copy_(src[e], non_blocking=True)
                self.held[s], self.slot_of[e] = e, s
        self.stats.bytes_uploaded += len(experts) * self.expert_bytes
        if stream is None:
            return None
        if join:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
            return None
        return stream.record_event()

    def _compute(self, x: torch.Tensor, ids: torch.Tensor, experts: list[int], y: torch.Tensor,
                 launch: object) -> None:
        """y's rows of the (token, expert) pairs of `experts` (all resident now)."""
        if not experts:
            return
        lut = torch.full((self.num_experts,), -1, dtype=torch.int64)
        lut[experts] = torch.tensor([self.slot_of[e] for e in experts])
        slots = lut.to(ids.device)[ids.reshape(-1)]
        pairs = torch.nonzero(slots >= 0).view(-1)
        rows = x.index_select(0, pairs // ids.shape[1])
        y[pairs] = self.math.pairs(rows, self.slot_tensors(), slots[pairs], launch)


def uploads_and_host(misses: list[int], routed: list[int], cap: int | None) -> tuple[list[int], list[int]]:
    """(misses to copy in, misses to compute on the host) under an upload cap: the `cap` misses
    with the most (token, expert) pairs in `routed` are copied, the rest stay on the host, each
    list in expert order. No cap: every miss is copied."""
    if cap is None or len(misses) <= cap:
        return misses, []
    count = Counter(routed)
    up = set(sorted(misses, key=lambda e: (-count[e], e))[:cap])
    return [e for e in misses if e in up], [e for e in misses if e not in up]


def install_expert_cache(model: nn.Module, slots: int, device: torch.device, stats: CacheStats,
                         policy: str = DEFAULT_POLICY, max_uploads: int | None = None,
                         prefetch: bool = False, mapped: int = 0) -> ExpertRefill | None:
    """Replace every sparse layer's experts (loaded to the host) by an ExpertCache of `slots`;
    `prefetch`: each cache predicts and copies in the next cached layer's experts (`look_ahead`);
    `mapped`: misses of steps of at most this many rows read in place, the copies between steps
    (0: off): returns the ExpertRefill the runner calls after each step (`max_uploads`: its
    copies per layer and step, default `DEFAULT_MAPPED_UPLOADS`)."""
    cached = []
    for i, layer in enumerate(model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None or isinstance(experts, ExpertCache) or experts.tensors()[0].is_meta:
            continue
        cache = ExpertCache(experts.math, experts.tensors(), min(slots, experts.num_experts), device, i, stats,
                            policy, None if mapped else max_uploads)
        router = layer.mlp.router.weight  # the rows the experts multiply: its width and dtype
        cache.fused = cache.math.maps(torch.empty(1, router.shape[1], dtype=router.dtype, device=device),
                                      cache.slot_tensors())
        layer.mlp.hold_experts(cache)
        cached.append(layer.mlp)
    if prefetch:
        for mlp, nxt in zip(cached, cached[1:], strict=False):
            mlp.experts.look_ahead(nxt.route, nxt.experts)
    if not mapped or not cached:
        return None
    uploads = DEFAULT_MAPPED_UPLOADS if max_uploads is None else max_uploads
    return ExpertRefill([mlp.experts for mlp in cached], cached[0].top_k, uploads, device, mapped)


def one_expert_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of one expert of expert-major tensors (its gate, up and down rows)."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


def expert_bytes(model: nn.Module) -> tuple[int, int, int]:
    """(bytes of one expert, sparse layers, experts per layer) of a model whose experts are
    loaded (0s for a dense model)."""
    for layer in model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            one = one_expert_bytes(experts.tensors())
            layers = sum(getattr(m.mlp, "experts", None) is not None for m in model.layers)
            return one, layers, int(experts.num_experts)
    return 0, 0, 0


def auto_slots(model: nn.Module, free_bytes: int, reserve_bytes: int) -> int:
    """Slots per layer that fit in `free_bytes` less `reserve_bytes` (at least 1; at most all)."""
    one, layers, experts = expert_bytes(model)
    if not layers:
        return 0
    fit = (free_bytes - reserve_bytes) // (one * layers)
    return int(max(1, min(experts, fit)))


def describe_cache(model: nn.Module, device: torch.device) -> str:
    """The start-up line of an expert cache: slots per layer, their bytes on the device, and the
    experts' bytes in host RAM."""
    caches = [layer.mlp.experts for layer in model.layers
              if isinstance(getattr(layer.mlp, "experts", None), ExpertCache)]
    if not caches:
        return "expert cache: none"
    slots = min(c.num_slots for c in caches)
    experts = caches[0].num_experts
    on_device = sum(c.num_slots * c.expert_bytes for c in caches)
    on_host = sum(c.num_experts * c.expert_bytes for c in caches)
    return (f"expert cache: {slots} of {experts} experts per layer on {device} ({len(caches)} layers, "
            f"{on_device / 2**30:.2f} GiB), all {experts} in host RAM ({on_host / 2**30:.2f} GiB)")
