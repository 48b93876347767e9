"""A CPU model's block weights moved into memory the kernel may back with 2 MiB pages.

Why: a decode step reads every weight once, from memory rather than cache, and a GGUF
file's mapping (where `--weights gguf` leaves its blocks) or torch's own allocations are
4 KiB pages: each 4 KiB of a product's stream then costs a TLB miss and a page walk. Copied
into one anonymous mapping advised `MADV_HUGEPAGE`, the same bytes stream faster: one Q4_1
product of the default model's gate/up shape read from memory took 106 us instead of 142,
and a decode step 8.0-8.2 ms instead of 8.6-9.2 (docs/PERFORMANCE.md). Where the system
gives no huge pages (transparent huge pages set to `never`) the copy costs nothing but the
copy; the bytes held stay those of the file.
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

from strata.models.block_experts import BlockExperts
from strata.models.blocks import BlockEmbedding, BlockLinear

log = logging.getLogger(__name__)

HUGE = 2 << 20  # the x86-64 huge page
MIN_BYTES = 8 << 20  # below this a few 4 KiB pages are all there is to save
ALIGN = 64  # each tensor starts on a cache line


def move_blocks_to_huge_pages(model: nn.Module) -> int:
    """Copy the bytes of every CPU block module (`BlockLinear`, `BlockEmbedding`,
    `BlockExperts`) into one mapping advised MADV_HUGEPAGE; their buffers become views of it
    (a tensor two modules share, a tied head's, stays shared). Returns the bytes moved: 0 where
    there is too little to gain, the system has no MADV_HUGEPAGE or no room for the copy."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    owners: list[tuple[nn.Module, str, torch.Tensor]] = []
    for mod in model.modules():
        if isinstance(mod, (BlockLinear, BlockEmbedding, BlockExperts)):
            owners += [(mod, n, b) for n, b in mod.named_buffers(recurse=False)
                       if b.device.type == "cpu" and b.dtype == torch.uint8 and b.is_contiguous()]
    unique: dict[int, torch.Tensor] = {}
    for _, _, b in owners:
        unique.setdefault(b.data_ptr(), b)
    sizes = {p: -(-b.numel() // ALIGN) * ALIGN for p, b in unique.items()}
    total = sum(sizes.values())
    if advice is None or total < MIN_BYTES:
        return 0
    try:
        area = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(advice)
    except OSError as e:  # no room for the copy: the blocks stay where they are, only slower
        log.warning("block weights stay in 4 KiB pages: no %.0f MB mapping for huge pages (%s)", total / 1e6, e)
        return 0
    base = torch.frombuffer(area, dtype=torch.uint8, count=1)  # only to learn the address
    start = (-base.data_ptr()) % HUGE
    # the tensor covers the aligned part only (its storage keeps `area` alive)
    region = torch.frombuffer(area, dtype=torch.uint8, count=total, offset=start)
    moved: dict[int, torch.Tensor] = {}
    at = 0
    for p, b in unique.items():
        view = region[at : at + b.numel()].view(b.shape)
        view.copy_(b)
        moved[p] = view
        at += sizes[p]
    for mod, name, b in owners:
        setattr(mod, name, moved[b.data_ptr()])
    log.debug("%.1f MB of block weights moved to memory advised for huge pages", total / 1e6)
    return total
