"""The CPU's block weights moved into one mapping advised for 2 MiB pages (`huge_pages.py`)."""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from strata.models.blocks import BlockEmbedding, BlockLinear, weight_bytes
from strata.models.huge_pages import HUGE, MIN_BYTES, move_blocks_to_huge_pages


def _q8_blocks(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random Q8_0 rows with a small finite fp16 scale in every block."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, cols // 32, 34), dtype=torch.uint8, generator=g)
    b[:, :, 0], b[:, :, 1] = 0x00, 0x20  # scale 2^-7
    return b.reshape(rows, -1)


class _Model(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.up = BlockLinear([(Q.Q8_0, _q8_blocks(rows, 1024, 1))], 1024)
        self.embed = BlockEmbedding(Q.Q8_0, _q8_blocks(rows, 1024, 2), 1024, torch.bfloat16)
        self.head = self.embed.head()  # tied: the same blocks


def _blocks(m: _Model) -> list[torch.Tensor]:
    return [m.up.blocks0, m.embed.blocks, m.head.blocks0]


def test_blocks_move_into_one_aligned_region_with_their_bytes() -> None:
    m = _Model(rows=4096)  # 2 x 4.5 MB of blocks
    before = [b.clone() for b in _blocks(m)]
    x = torch.randn(3, 1024).bfloat16()
    y_before, ids = m.up(x), torch.tensor([5, 4095, 0])
    e_before = m.embed(ids)
    moved = move_blocks_to_huge_pages(m)
    assert moved >= 2 * before[0].numel()
    after = _blocks(m)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    storages = {b.untyped_storage().data_ptr() for b in after}
    assert len(storages) == 1  # one region
    assert after[0].data_ptr() % HUGE == 0 or after[1].data_ptr() % HUGE == 0  # it starts on a huge page
    assert m.embed.blocks.data_ptr() == m.head.blocks0.data_ptr()  # the tied head still shares
    held = weight_bytes(m)["cpu"]
    assert held == moved and held <= 2 * before[0].numel() + 128  # no copy kept, no slack counted
    assert torch.equal(m.up(x), y_before) and torch.equal(m.embed(ids), e_before)


def test_small_models_are_left_where_they_are() -> None:
    m = _Model(rows=64)
    assert sum(b.numel() for b in _blocks(m)[:2]) < MIN_BYTES
    ptrs = [b.data_ptr() for b in _blocks(m)]
    assert move_blocks_to_huge_pages(m) == 0
    assert [b.data_ptr() for b in _blocks(m)] == ptrs


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0] if "[" in text else None


def _mapping_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def test_the_region_is_advised_for_huge_pages() -> None:
    """The moved region carries MADV_HUGEPAGE (smaps' VmFlags `hg`, shown whatever the system's
    huge page mode); where the mode lets advised memory have huge pages, smaps calls it eligible.
    The negative control: a fresh mapping of the same kind, not advised, has neither."""
    m = _Model(rows=4096)
    moved_bytes = move_blocks_to_huge_pages(m)
    assert moved_bytes > 0  # MADV_HUGEPAGE exists on Linux: a failed madvise would return 0
    moved = _mapping_flags(m.up.blocks0.data_ptr())
    assert "hg" in moved["VmFlags"].split()
    area = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    plain = torch.frombuffer(area, dtype=torch.uint8)
    plain.fill_(1)
    plain_flags = _mapping_flags(plain.data_ptr())
    assert "hg" not in plain_flags["VmFlags"].split()
    if _thp_mode() in ("always", "madvise") and "THPeligible" in moved:
        assert moved["THPeligible"] == "1"
        if _thp_mode() == "madvise":
            assert plain_flags.get("THPeligible") == "0"
