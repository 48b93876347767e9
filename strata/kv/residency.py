"""Which KV blocks stay on the device when streaming (`--kv-resident`): a pure policy.

The stream store (kv/stream.py) asks this module one question whenever the
blocks it must hold are more than its cache has slots for: of these
candidates (every resident block plus the blocks a read misses), which ones
stay? Nothing here touches memory, so the order can be tested on its own.

The order, most worth keeping first:
1. blocks the current read needs (evicting one of those costs a host read now;
   evicting any other block costs at most a copy later);
2. protected blocks: a lane's first blocks (attention sinks, read by every
   query with large weight), its most recent blocks (the ones decode keeps
   writing and reading), and every block of a short lane;
3. the most recently used;
4. blocks already resident (so equal candidates cause no copy);
5. the lower block id (a fixed tie-break: the same history gives the same cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ResidencyConfig:
    sink_blocks: int = 1  # a lane's first blocks kept resident
    recent_blocks: int = 2  # a lane's last blocks kept resident
    short_blocks: int = 4  # a lane spanning at most this many blocks keeps all of them


@dataclass(frozen=True)
class BlockUsage:
    """One entry per candidate block; all fields are 1-D tensors of the same length."""

    block: torch.Tensor  # int64 pool block id
    last_use: torch.Tensor  # int64 clock of the block's last read
    needed: torch.Tensor  # bool: the current read needs it
    resident: torch.Tensor  # bool: it is in the cache now
    index: torch.Tensor  # int64 block's index inside its lane; -1 when no lane owns it
    span: torch.Tensor  # int64 blocks its lane spans; 0 when no lane owns it

    def __len__(self) -> int:
        return int(self.block.numel())


def protected(index: torch.Tensor, span: torch.Tensor, cfg: ResidencyConfig) -> torch.Tensor:
    """Bool mask: sinks, recent blocks, and all blocks of short lanes (owned blocks only)."""
    owned = index >= 0
    sink = index < cfg.sink_blocks
    recent = index >= span - cfg.recent_blocks
    short = span <= cfg.short_blocks
    return owned & (sink | recent | short)


def keep_order(usage: BlockUsage, cfg: ResidencyConfig) -> torch.Tensor:
    """A permutation of the candidates, most worth keeping first (see the module docstring)."""
    prot = protected(usage.index, usage.span, cfg)
    # Stable sorts from the least to the most significant key.
    order = torch.argsort(usage.block, stable=True)
    for key in (usage.resident, usage.last_use, prot, usage.needed):
        k = key[order].to(torch.int64)
        order = order[torch.argsort(k, descending=True, stable=True)]
    return order


def choose_resident(usage: BlockUsage, capacity: int, cfg: ResidencyConfig) -> torch.Tensor:
    """Bool mask over the candidates: the at most `capacity` blocks the cache holds next."""
    keep = torch.zeros(len(usage), dtype=torch.bool)
    keep[keep_order(usage, cfg)[: max(0, capacity)]] = True
    return keep
