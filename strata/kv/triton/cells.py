"""Reading pool cells inside a kernel: table lookup and per-format dequantization.

Every kernel addresses K/V the same way the pool does: position p of a
session lives in cell `table[p // CHUNK] * CHUNK + p % CHUNK`. The table row
is read from the pool's device copy, so a kernel (or a captured graph) sees a
conversation move as soon as the tables are synced, without re-launch data.

Dequantization mirrors `strata.kv.quant` operation for operation (float32
products, one rounding to the compute dtype), so a kernel sees the very K/V
values the torch reference reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAIN = 0  # values stored as they are (fp32 / fp16 / bf16)
INT8 = 1  # int8 codes [cells, Hkv, D] with float32 scales [cells, Hkv]
Q4_0 = 2  # ggml Q4_0 blocks [cells, Hkv, D/32, 18] (float16 d, then 16 bytes of nibbles)


@triton.jit
def cells_of(table_row, pos, mask, CHUNK: tl.constexpr):
    """Cell indices (int64) of positions `pos` through one session's chunk table."""
    chunk = tl.load(table_row + pos // CHUNK, mask=mask, other=0)
    return chunk.to(tl.int64) * CHUNK + (pos % CHUNK).to(tl.int64)


@triton.jit
def load_tile(data, aux, cells, head, offs_d, mask_n, s_cell, s_head, a_cell, a_head,
              KIND: tl.constexpr, HEAD_DIM: tl.constexpr, OUT: tl.constexpr):
    """The [N, BLOCK_D] tile of one KV head at `cells`, dequantized to the compute dtype `OUT`.

    `data` is the run holding the values; `aux` holds int8's float32 scales
    ([cells, Hkv]) or, for Q4_0, the same bytes viewed as float16 (so each
    block's d is one aligned 2-byte load: blocks are 18 bytes, an even size).
    Masked rows and columns come back as zeros.
    """
    mask = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
    base = cells[:, None] * s_cell + head * s_head
    if KIND == 0:
        x = tl.load(data + base + offs_d[None, :], mask=mask, other=0.0).to(OUT)
    elif KIND == 1:
        codes = tl.load(data + base + offs_d[None, :], mask=mask, other=0)
        scale = tl.load(aux + cells * a_cell + head * a_head, mask=mask_n, other=0.0)
        x = (codes.to(tl.float32) * scale[:, None]).to(OUT)
    else:
        blk = offs_d // 32
        within = offs_d % 32
        byte = tl.load(data + base + (blk * 18 + 2 + within % 16)[None, :], mask=mask, other=0)
        code = (byte.to(tl.int32) >> ((within // 16) * 4)[None, :]) & 0xF
        d = tl.load(aux + cells[:, None] * a_cell + head * a_head + (blk * 9)[None, :],
                    mask=mask, other=0.0)
        x = ((code.to(tl.float32) - 8.0) * d.to(tl.float32)).to(OUT)
    return x
