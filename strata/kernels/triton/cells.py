"""Reading pool cells inside a kernel: table lookup and per-format tiles.

Every kernel addresses K/V the same way the pool does: position p of a
lane lives in cell `table[p // CHUNK] * CHUNK + p % CHUNK`. The table row
is read from the pool's device copy, so a kernel (or a captured graph) sees a
conversation move as soon as the tables are synced, without re-launch data.

Quantized tiles are made for the dot products, not for their reader:
- int8 tiles are the codes themselves (exact in bf16, fp16 and fp32) plus a
  float32 scale per row, which the kernel applies to whole rows of scores
  (K) or probabilities (V) instead of to every element;
- Q4_0 tiles are two half tiles (`q4_halves`: the low nibbles, then the
  high ones, each [N, D/2] in `half_dims` order), which need no join across
  threads (large dots do not compile from tiles whose nibbles sit side by
  side: Triton 3.6, sm_90) and load each byte and each block's d once; K's
  scores are two dots from q's matching halves. Scaled tiles hold
  `(code - 8) * d` in float32, rounded once to the compute dtype, as
  `strata.kv.quant` does. The decode kernel's V tiles hold the codes alone
  and each block's d scales the probabilities (`block_scales`,
  `select_blocks`), except in fp16 compute, where p x d could underflow and
  the tiles are scaled; the prompt kernel's are scaled;
- no code becomes a float through an integer-to-float conversion (a slow
  pipe): it is or'ed into the mantissa of 2**23 (`int8_floats`, `q4_floats`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cells_of(table_row, pos, mask, CHUNK: tl.constexpr):
    """Cell indices (int64) of positions `pos` through one lane's chunk table."""
    chunk = tl.load(table_row + pos // CHUNK, mask=mask, other=0)
    return chunk.to(tl.int64) * CHUNK + (pos % CHUNK).to(tl.int64)


@triton.jit
def int8_floats(codes):
    """int8 codes as float32, exactly, without an integer-to-float conversion (a slow pipe: in a
    prompt tile of 64 x 128 codes it costs more than the tile's dots): code + 128, or'ed into
    the mantissa of 2**23, is the float 2**23 + 128 + code."""
    u = codes.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80  # code + 128
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def q4_floats(code):
    """Q4_0 nibbles (int32, 0..15) as float32 code - 8, exactly, the same way: 2**23 + code
    less 2**23 + 8."""
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def load_tile(data, aux, cells, head, mask_n, s_cell, s_head, a_cell, a_head,
              KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              OUT: tl.constexpr, SCALED: tl.constexpr):
    """(tile [N, BLOCK_D] in `OUT`, row scale [N] float32) of one KV head at `cells`, PLAIN
    or INT8 (Q4_0 comes as half tiles, `q4_halves`).

    The tile's value at (n, c) times the row scale of n is the cell's value at
    head dimension c. PLAIN returns scale 1; INT8 returns its codes and
    scales, or with SCALED their products rounded to `OUT` (the reference's
    values) and scale 1. `aux` holds int8's scales. Masked rows and columns
    come back as zeros.
    """
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
    ptr = data + cells[:, None] * s_cell + head * s_head + offs_d[None, :]
    if KIND == 0:
        x = tl.load(ptr, mask=mask, other=0.0).to(OUT)
        scale = tl.full(mask_n.shape, 1.0, tl.float32)
    else:
        tl.static_assert(KIND == 1, "load_tile reads PLAIN and INT8 cells")
        codes = tl.load(ptr, mask=mask, other=0)
        scale = tl.load(aux + cells * a_cell + head * a_head, mask=mask_n, other=0.0)
        if SCALED:
            x = (int8_floats(codes) * scale[:, None]).to(OUT)
            scale = tl.full(mask_n.shape, 1.0, tl.float32)
        else:
            x = int8_floats(codes).to(OUT)
    return x, scale


@triton.jit
def half_dims(offs_h, HIGH: tl.constexpr):
    """Head dimension of each column of a Q4_0 half tile (`q4_halves`).

    Column c of the low half is element c % 16 of block c // 16; the high
    half holds the same blocks' elements 16..31.
    """
    return (offs_h // 16) * 32 + offs_h % 16 + 16 * HIGH


@triton.jit
def q4_halves(data, aux, cells, head, mask_n, s_cell, s_head, a_cell, a_head,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, OUT: tl.constexpr,
              SCALED: tl.constexpr, BIASED: tl.constexpr, IN_BOUNDS: tl.constexpr):
    """(low, high) half tiles [N, BLOCK_D / 2] in `OUT` of Q4_0 rows, in `half_dims` order.

    Each byte is loaded once and no tile is joined or reshaped across
    threads, and no integer is converted to float: a nibble or'ed into the
    mantissa of 2**23 (float32) or 128 (bf16) is that float plus the nibble.
    SCALED: `(code - 8) * d`, rounded once from float32 as `strata.kv.quant`
    does. Else the codes, exact: BIASED (bf16 `OUT`) gives code + 128, so the
    kernel subtracts 136 times its probability sums; unbiased, code - 8.
    Masked rows and blocks hold zero bytes: zeros when SCALED (d = 0), else
    codes the kernel's zero probabilities or its output mask discard.
    IN_BOUNDS (unscaled only): every row's cell exists and HEAD_DIM fills the
    tile, so the codes are loaded unmasked (masked rows: finite codes, zero p).
    """
    NB: tl.constexpr = BLOCK_D // 32
    blk = tl.arange(0, NB)[None, :, None]
    offs_j = tl.arange(0, 16)[None, None, :]
    c3 = cells[:, None, None]
    mask = mask_n[:, None, None] & (blk < HEAD_DIM // 32)
    ptr = data + c3 * s_cell + head * s_head + blk * 18 + 2 + offs_j
    if IN_BOUNDS and not SCALED and HEAD_DIM == BLOCK_D:
        byte = tl.load(ptr)
    else:
        byte = tl.load(ptr, mask=mask, other=0)
    b = byte.to(tl.int32)
    if SCALED:
        d = tl.load(aux + c3 * a_cell + head * a_head + blk * 9, mask=mask, other=0.0).to(tl.float32)
        lo = q4_floats(b & 0xF)
        hi = q4_floats(b >> 4)
        lo = (lo * d).to(OUT)
        hi = (hi * d).to(OUT)
    elif BIASED:
        lo = ((b & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = ((b >> 4) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        lo = ((b & 0xF) - 8).to(OUT)
        hi = ((b >> 4) - 8).to(OUT)
    n: tl.constexpr = cells.shape[0]
    return tl.reshape(lo, [n, BLOCK_D // 2]), tl.reshape(hi, [n, BLOCK_D // 2])


@triton.jit
def block_scales(aux, cells, head, mask_n, a_cell, a_head, BLOCK_G: tl.constexpr,
                 BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[BLOCK_R, N] float32: row r holds d of block r // BLOCK_G of every cell (0 where masked)."""
    blk = tl.arange(0, BLOCK_R) // BLOCK_G
    mask = (blk < HEAD_DIM // 32)[:, None] & mask_n[None, :]
    return tl.load(aux + cells[None, :] * a_cell + head * a_head + (blk * 9)[:, None],
                   mask=mask, other=0.0).to(tl.float32)


@triton.jit
def scores(qt, k, k_scale, qk_scale, K_KIND: tl.constexpr, IEEE: tl.constexpr):
    """Scaled scores qt @ k.T in float32 (log2 units), an int8 tile's row scales applied."""
    if IEEE:  # float32: exact products (Triton's default for float32 is TF32)
        s = tl.dot(qt, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(qt, tl.trans(k))
    if K_KIND == 1:  # int8 codes: their scale applies to whole score columns
        return s * (k_scale * qk_scale)[None, :]
    else:
        return s * qk_scale


@triton.jit
def half_scores(q_lo, q_hi, k_lo, k_hi, qk_scale, IEEE: tl.constexpr):
    """Scaled scores (log2 units) from Q4_0 half tiles and q's matching halves."""
    if IEEE:
        s = tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
        s = tl.dot(q_hi, tl.trans(k_hi), s, input_precision="ieee")
    else:
        s = tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo)))
    return s * qk_scale


@triton.jit
def load_queries(q_rows, mask_r, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HALVES: tl.constexpr):
    """(q_a, q_b) of query rows at `q_rows` [R, 1] (pointers to each row's head): the low and
    high half tiles in `half_dims` order (HALVES: for a Q4_0 K), else the whole rows, twice."""
    if HALVES:
        offs_h = tl.arange(0, BLOCK_D // 2)
        dims_lo = half_dims(offs_h, 0)
        dims_hi = half_dims(offs_h, 1)
        q_lo = tl.load(q_rows + dims_lo[None, :], mask=mask_r[:, None] & (dims_lo < HEAD_DIM)[None, :], other=0.0)
        q_hi = tl.load(q_rows + dims_hi[None, :], mask=mask_r[:, None] & (dims_hi < HEAD_DIM)[None, :], other=0.0)
        return q_lo, q_hi
    else:
        offs_d = tl.arange(0, BLOCK_D)
        qt = tl.load(q_rows + offs_d[None, :], mask=mask_r[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        return qt, qt


@triton.jit
def key_scores(q_a, q_b, data, aux, cells, head, mask_n, s_cell, s_head, a_cell, a_head,
               KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, OUT: tl.constexpr,
               qk_scale, IEEE: tl.constexpr):
    """Scaled scores (log2 units) of the queries (`load_queries`'s pair) against one K tile."""
    if KIND == 2:
        k_lo, k_hi = q4_halves(data, aux, cells, head, mask_n, s_cell, s_head, a_cell, a_head,
                               HEAD_DIM, BLOCK_D, OUT, True, False, False)
        return half_scores(q_a, q_b, k_lo, k_hi, qk_scale, IEEE)
    else:
        k, k_scale = load_tile(data, aux, cells, head, mask_n, s_cell, s_head, a_cell, a_head,
                               KIND, HEAD_DIM, BLOCK_D, OUT, False)
        return scores(q_a, k, k_scale, qk_scale, KIND, IEEE)


@triton.jit
def select_blocks(o, BLOCK_G: tl.constexpr, NB: tl.constexpr):
    """[BLOCK_G, W] from a half-tile accumulator [NB * BLOCK_G, W] whose row b * BLOCK_G + g
    weighed block b's scales: column c of query head g is row (c // 16) * BLOCK_G + g."""
    W: tl.constexpr = o.shape[1]
    rows = tl.arange(0, NB * BLOCK_G)
    keep = (rows // BLOCK_G)[:, None] == (tl.arange(0, W) // 16)[None, :]
    return tl.sum(tl.reshape(tl.where(keep, o, 0.0), [NB, BLOCK_G, W]), 0)


@triton.jit
def accumulate(acc, alpha, p, v, v_scale, V_KIND: tl.constexpr, FOLD_V: tl.constexpr,
               IEEE: tl.constexpr):
    """acc * alpha + p @ v; int8 V codes (unless dequantized) weigh p by their row scales."""
    if V_KIND == 1 and FOLD_V:
        p = p * v_scale[None, :]
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def accumulate_halves(acc_lo, acc_hi, alpha, pv, v_lo, v_hi, IEEE: tl.constexpr):
    """(acc_lo, acc_hi) * alpha + pv @ (v_lo, v_hi): `accumulate` over Q4_0 half tiles."""
    if IEEE:
        acc_lo = acc_lo * alpha[:, None] + tl.dot(pv, v_lo, input_precision="ieee")
        acc_hi = acc_hi * alpha[:, None] + tl.dot(pv, v_hi, input_precision="ieee")
    else:
        acc_lo = acc_lo * alpha[:, None] + tl.dot(pv, v_lo)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(pv, v_hi)
    return acc_lo, acc_hi


@triton.jit
def _signs(rows, BLOCK_D: tl.constexpr):
    """H[rows, :] (+-1, bf16-exact) as float32: (-1) ** popcount(i & j)."""
    cols = tl.arange(0, BLOCK_D)
    p = rows[:, None] & cols[None, :]
    p = p ^ (p >> 16)
    p = p ^ (p >> 8)
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return tl.where((p & 1) == 1, -1.0, 1.0)


@triton.jit
def hadamard_halves(o_lo, o_hi, rows_lo, rows_hi, BLOCK_D: tl.constexpr, SCALE: tl.constexpr,
                    IEEE: tl.constexpr):
    """o @ H * SCALE for an output o [M, BLOCK_D] float32 held as two half tiles (columns
    `rows_lo`, `rows_hi` of o): k8v4's rotation of the output back.

    SCALE is 1 / sqrt(D). H's entries are +-1, (-1) ** popcount(i & j), exact in
    bf16, so the product runs on the tensor cores with each half split into a bf16
    head and tail (about 16 bits of mantissa, far below the bf16 or fp16 output's
    rounding), one accumulator for both halves; float32 compute takes IEEE products.
    """
    if IEEE:
        r = tl.dot(o_lo, _signs(rows_lo, BLOCK_D), input_precision="ieee")
        r = tl.dot(o_hi, _signs(rows_hi, BLOCK_D), r, input_precision="ieee")
    else:
        h = _signs(rows_lo, BLOCK_D).to(tl.bfloat16)
        head = o_lo.to(tl.bfloat16)
        r = tl.dot(head, h)
        r = tl.dot((o_lo - head.to(tl.float32)).to(tl.bfloat16), h, r)
        h = _signs(rows_hi, BLOCK_D).to(tl.bfloat16)
        head = o_hi.to(tl.bfloat16)
        r = tl.dot(head, h, r)
        r = tl.dot((o_hi - head.to(tl.float32)).to(tl.bfloat16), h, r)
    return r * SCALE
