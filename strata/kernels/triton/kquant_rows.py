"""One-row products of packed Q4_K, Q6_K and Q8_0 blocks by group sums, in Gluon (one-lane decode).

`blocks.block_gemv` decodes every weight to its float32 value and multiplies
it: 8-26 instructions a weight by the compiled code (`tools/kernel_sass.py`),
so a Q4_K row is read at a fifth of the copy bandwidth. Here a weight costs
three instructions, plus its share of the group's scales and of the inputs
(about five in all):
within a scale group of 32 values ggml's weight is `a * q - b` (a = d * sc,
b = dmin * m), so

    sum(w * x) = a * sum(q * x) - b * sum(x)

and each quant only has to be turned into a float and multiplied. The nibble
is shifted into bits 19-22 of 1.0f (one shift, one `lop3` that also sets the
exponent), giving f = 1 + q / 16 exactly; then `sum(f * x) = sum(x) + sum(q * x) / 16`,
so a group adds `16 a * sum(f * x) - (16 a + b) * sum(x)`. The sums run in
float32 in a fixed order that depends on the row's length only (no split-K),
so a graph replay equals the eager run; the result differs from the decode-
then-multiply kernel's by float32 rounding (the tests bound it as theirs).

Gluon (Triton's explicit-layout dialect) fixes what each thread holds: one
32-byte chunk of quants (64 weights, two scale groups) of each of its rows,
and the 64 matching bf16 inputs as 64-bit words, so the inputs are converted
once for all the rows a thread owns and the quants load as 16-byte vectors.
Inputs must be bf16 and the blocks packed (`blocks_decode.pack`); anything
else takes `blocks.block_gemv`'s kernel (`takes`). Q6_K (`_q6k_kernel`) is
the same with `1 + q / 64` over groups of 16, Q8_0 (`_q8_kernel`) with
`1 + (q + 128) / 256` over its blocks of 32.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
from gguf import GGMLQuantizationType as T

try:  # Gluon ships with Triton 3.5+; without it every row takes blocks.block_gemv
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = gl = None

from strata.kernels.triton import fused
from strata.kernels.triton.blocks_decode import layout
from strata.kernels.triton.gemv import INTERPRET, pdl_on

log = logging.getLogger(__name__)
Config = tuple[int, int, int]  # (rows a thread, threads a warp along rows, warps)
# (N, K, qtype) -> Config; N counts gate rows only for gate/up. From `benchmarks.block_sweep`.
CONFIGS: dict[tuple[int, int, int], Config] = {}


def default_config(n: int, k: int, qtype: int) -> Config:
    """Four Q4_K or Q8_0 rows a thread (two gate and two up rows with silu; Q6_K: two, whose high
    bits take twice the registers), two warps; a warp's 32 threads along the row's chunks (64
    values, Q8_0's 32) where a row has 128 or more of them, else 16 threads along the chunks and
    two along the rows (the best of the sweep on the 8B shapes; Q8_0 not swept yet)."""
    if (n, k, qtype) in CONFIGS:
        return CONFIGS[(n, k, qtype)]
    chunks = k // (32 if qtype == T.Q8_0 else 64)
    return 2 if qtype == T.Q6_K else 4, 1 if chunks >= 128 else 2, 2


# The types block_gemv sends here: every kernel here, since each passed
# tests/gpu/test_block_kernels.py::test_group_sums on an H100 (Q6_K and Q8_0 on 2026-12-07); their
# speed against the old kernel is measured for Q4_K only (docs/PERFORMANCE.md).
ROUTED = (T.Q4_K, T.Q6_K, T.Q8_0)


ROW_MULTIPLE = {T.Q4_K: 256, T.Q6_K: 512, T.Q8_0: 128}  # values a row is a multiple of, per type
_FAILED: set[int] = set()  # types whose kernel this Triton could not compile (`fall_back`)


def takes(x: torch.Tensor, qtype: int, packed: bool) -> bool:
    """Whether block_gemv computes x [1, K] times packed `qtype` blocks here."""
    return qtype in ROUTED and qtype not in _FAILED and computes(x, qtype, packed)


def fall_back(qtype: int, error: Exception) -> None:
    """A Triton whose Gluon differs from the one these kernels are written for fails to compile
    them: say so once, and leave `qtype` on block_gemv's kernel from now on."""
    if qtype not in _FAILED:
        _FAILED.add(qtype)
        log.warning("the group-sum kernel for %s blocks did not compile with Triton %s (%s); "
                    "one-row products of them take the decode-then-multiply kernel",
                    T(qtype).name, triton.__version__, str(error).splitlines()[0][:200])


def computes(x: torch.Tensor, qtype: int, packed: bool) -> bool:
    """Whether `kq_gemv` can compute x [1, K] times packed `qtype` blocks: bf16 CUDA rows of
    whole 64-bit words of blocks (Q6_K's 210-byte blocks: an even number of them; Q8_0's 34:
    a multiple of 4), the row starting on 16 bytes (it is read as 64-bit words)."""
    return (gl is not None and not INTERPRET and x.is_cuda and packed and qtype in ROW_MULTIPLE
            and x.dtype == torch.bfloat16 and x.shape[1] % ROW_MULTIPLE[qtype] == 0
            and x.data_ptr() % 16 == 0)


if gl is not None:

    @gluon.jit
    def _move(q, FROM: gl.constexpr, TO: gl.constexpr):
        """The words shifted so that bit FROM lands on bit TO."""
        if FROM <= TO:
            t = q << (TO - FROM)
        else:
            t = q >> (FROM - TO)
        return t

    @gluon.jit
    def _or_masked(t, MASK: gl.constexpr, base):
        """(t & MASK) | base in one lop3 (ptxas emits an and and an or for the same in C)."""
        return gl.inline_asm_elementwise(f"lop3.b32 $0, $1, {MASK}, $2, 0xEA;", "=r,r,r", [t, base],
                                         dtype=gl.uint32, is_pure=True, pack=1)

    @gluon.jit
    def _nibble(q, SH: gl.constexpr, one):
        """float32 1 + n / 16 for the nibble at bits SH .. SH + 3 of each word: the nibble
        moved to bits 19-22 of 1.0f."""
        return _or_masked(_move(q, SH, 19), 0x780000, one).to(gl.float32, bitcast=True)

    @gluon.jit
    def _lane(w, I: gl.constexpr):
        """float32 of the bf16 in 16-bit lane I of each 64-bit word (exact)."""
        return (((w >> (16 * I)) & 0xFFFF).to(gl.uint32) << 16).to(gl.float32, bitcast=True)

    @gluon.jit
    def _scale_min(b, at, j, ok):
        """Sub-block j's 6-bit scale and min from the 12 packed bytes at `at` (get_scale_min_k4)."""
        lo = j < 4
        sj = gl.load(b + at + j, mask=ok, other=0).to(gl.int32)
        s4 = gl.load(b + at + j + 4, mask=ok, other=0).to(gl.int32)
        sm = gl.load(b + at + (j % 4), mask=ok, other=0).to(gl.int32)
        sc = gl.where(lo, sj & 63, (s4 & 15) | ((sm >> 6) << 4))
        mn = gl.where(lo, s4 & 63, (s4 >> 4) | ((sj >> 6) << 4))
        return sc.to(gl.float32), mn.to(gl.float32)

    @gluon.jit
    def _after_previous(PDL: gl.constexpr):
        """With programmatic dependent launch: let the next kernel start its programs, then wait
        for the previous kernel's writes (x, the residual) before anything is read."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _row_bytes(pid, N, BN: gl.constexpr, OUTS: gl.constexpr, RS: gl.constexpr,
                   SILU: gl.constexpr, L2: gl.constexpr):
        """Byte offsets of the program's BN weight rows (SILU: gate and up rows alternating);
        rows past N read row 0."""
        ri = gl.arange(0, BN, layout=gl.SliceLayout(1, L2))
        if SILU:
            wrow = pid * OUTS + ri // 2 + (ri % 2) * N
            valid = pid * OUTS + ri // 2 < N
        else:
            wrow = pid * BN + ri
            valid = wrow < N
        return gl.where(valid, wrow, 0).to(gl.int64) * RS

    @gluon.jit
    def _program(x, b, pid, N, BN: gl.constexpr, OUTS: gl.constexpr, CH: gl.constexpr,
                 RS: gl.constexpr, SILU: gl.constexpr, L: gl.constexpr):
        """What a [rows, chunks, 8 words] program (layout L) works with: its rows' byte offsets
        [BN, 1] and word offsets [BN, 1, 1], the chunk index [1, CH] of the weights' view, the
        chunk index [CH] and word index [1, 8] of the inputs' view (and [1, 1, 8] against the
        weights), 1.0f's bits [BN, CH, 8], and x and b as 64-bit and 32-bit words."""
        L2: gl.constexpr = gl.SliceLayout(2, L)
        LX: gl.constexpr = gl.SliceLayout(0, L)
        rb = gl.expand_dims(_row_bytes(pid, N, BN, OUTS, RS, SILU, L2), 1)
        rw = gl.expand_dims(rb // 4, 2)
        c2 = gl.expand_dims(gl.arange(0, CH, layout=gl.SliceLayout(0, L2)), 0)
        cx = gl.arange(0, CH, layout=gl.SliceLayout(1, LX))
        jx = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, LX)), 0)
        one = gl.full([BN, CH, 8], 0x3F800000, gl.uint32, layout=L)
        return (rb, rw, c2, cx, jx, gl.expand_dims(jx, 0), one, x.to(gl.pointer_type(gl.int64), bitcast=True),
                b.to(gl.pointer_type(gl.uint32), bitcast=True))

    @gluon.jit
    def _chunks_at(it, c2, cx, jx, NCH: gl.constexpr, XW: gl.constexpr):
        """Iteration `it`'s chunks: the inputs' word offsets [CH, 8] (XW words a chunk), which
        chunks exist [1, CH], and the chunk index clamped to the row [1, CH]."""
        atx = gl.expand_dims(gl.minimum(it + cx, NCH - 1) * XW, 1) + jx
        ch = it + c2
        return atx, ch < NCH, gl.minimum(ch, NCH - 1)

    @gluon.jit
    def _finish(y, out, res, pid, N, OUTS: gl.constexpr, WARPS: gl.constexpr, SILU: gl.constexpr,
                RESIDUAL: gl.constexpr):
        """The rows' sums rounded to bf16, then silu(gate) * up, the residual, the store: as
        blocks._gemv_kernel rounds them."""
        y = y.to(gl.bfloat16).to(gl.float32)
        if SILU:
            gate, up = gl.split(gl.reshape(y, [OUTS, 2]))
            y = gl.div_rn(gate, 1.0 + gl.exp(-gate)).to(gl.bfloat16).to(gl.float32) * up
        LO: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        y = gl.convert_layout(y, LO)
        orow = pid * OUTS + gl.arange(0, OUTS, layout=LO)
        oc = gl.where(orow < N, orow, 0)
        if RESIDUAL:
            y = gl.load(res + oc).to(gl.float32) + y
        gl.store(out + orow, y.to(out.dtype.element_ty), mask=orow < N)

    @gluon.jit
    def _q4k_kernel(x, b, h, out, res, N, K: gl.constexpr, OSC: gl.constexpr, OD: gl.constexpr,
                    OM: gl.constexpr, RPT: gl.constexpr, TR: gl.constexpr, WARPS: gl.constexpr,
                    SILU: gl.constexpr, RESIDUAL: gl.constexpr, PDL: gl.constexpr):
        """A program owns BN = RPT * TR weight rows (with SILU: gate and up rows alternating)
        and walks their 64-value chunks, CH at a time, one chunk a thread."""
        L: gl.constexpr = gl.BlockedLayout([RPT, 1, 8], [TR, 32 // TR, 1], [1, WARPS, 1], [2, 1, 0])
        L2: gl.constexpr = gl.SliceLayout(2, L)  # [rows, chunks]
        BN: gl.constexpr = RPT * TR
        CH: gl.constexpr = (32 // TR) * WARPS
        NB: gl.constexpr = K // 256
        NCH: gl.constexpr = NB * 4  # chunks of 32 quant bytes a row
        RS: gl.constexpr = NB * 144
        OUTS: gl.constexpr = BN // 2 if SILU else BN
        _after_previous(PDL)
        pid = gl.program_id(0)
        rb, rw, c2, cx, jx, j3, one, xw, bw = _program(x, b, pid, N, BN, OUTS, CH, RS, SILU, L)
        acc = gl.zeros([BN, CH], gl.float32, layout=L2)
        for it in range(0, NCH, CH):
            atx, ok, chc = _chunks_at(it, c2, cx, jx, NCH, 16)  # 64-bit words: 4 inputs each
            blk = chc // 4
            p = chc % 4
            q = gl.load(bw + rw + gl.expand_dims(chc * 8, 2) + j3)  # [BN, CH, 8] words
            s_lo = gl.zeros([BN, CH], gl.float32, layout=L2)
            s_hi = gl.zeros([BN, CH], gl.float32, layout=L2)
            x_lo = gl.zeros([1, CH], gl.float32, layout=L2)
            x_hi = gl.zeros([1, CH], gl.float32, layout=L2)
            wl = gl.load(xw + atx)
            wh = gl.load(xw + atx + 8)  # the hi nibbles' inputs, 32 columns on
            for i in gl.static_range(4):  # byte i of each word: its two nibbles
                vl = gl.expand_dims(_lane(wl, i), 0)
                vh = gl.expand_dims(_lane(wh, i), 0)
                s_lo += gl.sum(_nibble(q, 8 * i, one) * vl, 2)
                s_hi += gl.sum(_nibble(q, 8 * i + 4, one) * vh, 2)
                x_lo += gl.sum(vl, 2)
                x_hi += gl.sum(vh, 2)
            sc_lo, m_lo = _scale_min(b, rb + OSC + blk * 12, 2 * p, ok)
            sc_hi, m_hi = _scale_min(b, rb + OSC + blk * 12, 2 * p + 1, ok)
            d = gl.load(h + (rb + OD + blk * 2) // 2).to(gl.float32)
            dmin = gl.load(h + (rb + OM + blk * 2) // 2).to(gl.float32)
            a_lo = d * sc_lo * 16.0
            a_hi = d * sc_hi * 16.0
            t = a_lo * s_lo - (a_lo + dmin * m_lo) * x_lo + a_hi * s_hi - (a_hi + dmin * m_hi) * x_hi
            acc += gl.where(ok, t, 0.0)
        _finish(gl.sum(acc, 1), out, res, pid, N, OUTS, WARPS, SILU, RESIDUAL)

    @gluon.jit
    def _six(ql, qh, SH: gl.constexpr, one):
        """float32 1 + q / 64 for the 6-bit q whose low nibble sits at bits SH .. SH + 3 of ql
        and whose two high bits at bits SH - (SH % 8) .. + 1 of qh (already shifted per part)."""
        t = _or_masked(_move(ql, SH, 17), 0x1E0000, one)  # bits 17-20
        t = _or_masked(_move(qh, SH - SH % 8, 21), 0x600000, t)  # bits 21-22
        return t.to(gl.float32, bitcast=True)

    @gluon.jit
    def _q6k_kernel(x, b, h, out, res, N, K: gl.constexpr, OH: gl.constexpr, OSC: gl.constexpr,
                    OD: gl.constexpr, RPT: gl.constexpr, TR: gl.constexpr, WARPS: gl.constexpr,
                    SILU: gl.constexpr, RESIDUAL: gl.constexpr, PDL: gl.constexpr):
        """As _q4k_kernel for Q6_K: a thread's chunk is 32 bytes of one half's low nibbles (values
        l0 + l and 64 + l0 + l of the half, l < 32) with the 32 high-bit bytes they share with the
        other chunk of the half; w = d * sc * (q - 32) over groups of 16, so a group adds
        64 d sc * sum(f * x) - 96 d sc * sum(x) for f = 1 + q / 64."""
        L: gl.constexpr = gl.BlockedLayout([RPT, 1, 2, 4], [TR, 32 // TR, 1, 1], [1, WARPS, 1, 1],
                                           [3, 2, 1, 0])
        L3: gl.constexpr = gl.SliceLayout(3, L)  # [rows, chunks, 2 groups]
        L2: gl.constexpr = gl.SliceLayout(2, L3)  # [rows, chunks]
        LX: gl.constexpr = gl.SliceLayout(0, L)  # [chunks, 2, 4 words]
        BN: gl.constexpr = RPT * TR
        CH: gl.constexpr = (32 // TR) * WARPS
        NB: gl.constexpr = K // 256
        NCH: gl.constexpr = NB * 4
        RS: gl.constexpr = NB * 210
        OUTS: gl.constexpr = BN // 2 if SILU else BN
        _after_previous(PDL)
        pid = gl.program_id(0)
        rb2 = gl.expand_dims(_row_bytes(pid, N, BN, OUTS, RS, SILU, L2), 1)  # [BN, 1] bytes
        rb3 = gl.expand_dims(rb2, 2)  # [BN, 1, 1]
        rw = gl.expand_dims(rb3 // 4, 3)  # [BN, 1, 1, 1] words
        c2 = gl.expand_dims(gl.arange(0, CH, layout=gl.SliceLayout(0, L2)), 0)  # [1, CH]
        g3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3))), 0), 0)
        LXC: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LX))
        cx = gl.arange(0, CH, layout=LXC)
        gx = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX))), 0), 2)
        jx = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, LX))), 0), 0)
        wx = gx * 4 + jx  # [1, 2, 4]: word of the chunk
        w4 = gl.expand_dims(wx, 0)  # [1, 1, 2, 4]
        one = gl.full([BN, CH, 2, 4], 0x3F800000, gl.uint32, layout=L)
        xw = x.to(gl.pointer_type(gl.int64), bitcast=True)
        bw = b.to(gl.pointer_type(gl.uint32), bitcast=True)
        acc = gl.zeros([BN, CH], gl.float32, layout=L2)
        for it in range(0, NCH, CH):
            chx = gl.minimum(it + cx, NCH - 1)
            atx = gl.expand_dims(gl.expand_dims((chx // 4) * 64 + ((chx % 4) // 2) * 32 + (chx % 2) * 8, 1), 2) + wx
            ch = it + c2
            ok = ch < NCH
            chc = gl.minimum(ch, NCH - 1)
            blk = chc // 4
            half = (chc % 4) // 2
            sub = chc % 2  # l0 = 32 sub
            ql = gl.load(bw + rw + gl.expand_dims(gl.expand_dims((blk * 32 + (chc % 4) * 8), 2), 3) + w4)
            qh = gl.load(bw + rw + gl.expand_dims(gl.expand_dims((OH + blk * 64 + half * 32) // 4, 2), 3) + w4)
            s4 = gl.expand_dims(gl.expand_dims(sub * 2, 2), 3)
            qh_lo = qh >> s4.to(gl.uint32)
            qh_hi = qh >> (s4 + 4).to(gl.uint32)
            wl = gl.load(xw + atx)
            wh = gl.load(xw + atx + 16)  # the hi nibbles' inputs, 64 columns on
            s_lo = gl.zeros([BN, CH, 2], gl.float32, layout=L3)
            s_hi = gl.zeros([BN, CH, 2], gl.float32, layout=L3)
            x_lo = gl.zeros([1, CH, 2], gl.float32, layout=L3)
            x_hi = gl.zeros([1, CH, 2], gl.float32, layout=L3)
            for i in gl.static_range(4):
                vl = gl.expand_dims(_lane(wl, i), 0)
                vh = gl.expand_dims(_lane(wh, i), 0)
                s_lo += gl.sum(_six(ql, qh_lo, 8 * i, one) * vl, 3)
                s_hi += gl.sum(_six(ql, qh_hi, 8 * i + 4, one) * vh, 3)
                x_lo += gl.sum(vl, 3)
                x_hi += gl.sum(vh, 3)
            sat = rb3 + OSC + gl.expand_dims(blk * 16 + half * 8 + sub * 2, 2) + g3
            ok3 = gl.expand_dims(ok, 2)
            sc_lo = gl.load(b.to(gl.pointer_type(gl.int8), bitcast=True) + sat, mask=ok3, other=0).to(gl.float32)
            sc_hi = gl.load(b.to(gl.pointer_type(gl.int8), bitcast=True) + sat + 4, mask=ok3, other=0).to(gl.float32)
            d = gl.expand_dims(gl.load(h + (rb2 + OD + blk * 2) // 2).to(gl.float32), 2)
            a_lo = d * sc_lo
            a_hi = d * sc_hi
            t = a_lo * (64.0 * s_lo - 96.0 * x_lo) + a_hi * (64.0 * s_hi - 96.0 * x_hi)
            acc += gl.where(ok, gl.sum(t, 2), 0.0)
        _finish(gl.sum(acc, 1), out, res, pid, N, OUTS, WARPS, SILU, RESIDUAL)

    @gluon.jit
    def _q8_kernel(x, b, h, out, res, N, K: gl.constexpr, OD: gl.constexpr, RPT: gl.constexpr,
                   TR: gl.constexpr, WARPS: gl.constexpr, SILU: gl.constexpr, RESIDUAL: gl.constexpr,
                   PDL: gl.constexpr):
        """As _q4k_kernel for Q8_0: a thread's chunk is one block's 32 int8 quants (8 words); with
        u = q + 128 moved into bits 15-22 of 1.0f, f = 1 + u / 256 and a block adds
        d * (256 * sum(f * x) - 384 * sum(x))."""
        L: gl.constexpr = gl.BlockedLayout([RPT, 1, 8], [TR, 32 // TR, 1], [1, WARPS, 1], [2, 1, 0])
        L2: gl.constexpr = gl.SliceLayout(2, L)  # [rows, chunks]
        BN: gl.constexpr = RPT * TR
        CH: gl.constexpr = (32 // TR) * WARPS
        NCH: gl.constexpr = K // 32  # blocks a row
        RS: gl.constexpr = NCH * 34
        OUTS: gl.constexpr = BN // 2 if SILU else BN
        _after_previous(PDL)
        pid = gl.program_id(0)
        rb, rw, c2, cx, jx, j3, one, xw, bw = _program(x, b, pid, N, BN, OUTS, CH, RS, SILU, L)
        acc = gl.zeros([BN, CH], gl.float32, layout=L2)
        for it in range(0, NCH, CH):
            atx, ok, chc = _chunks_at(it, c2, cx, jx, NCH, 8)
            u = gl.load(bw + rw + gl.expand_dims(chc * 8, 2) + j3) ^ 0x80808080  # [BN, CH, 8] words
            wx = gl.load(xw + atx)
            s = gl.zeros([BN, CH], gl.float32, layout=L2)
            xs = gl.zeros([1, CH], gl.float32, layout=L2)
            for i in gl.static_range(4):  # byte i of each word
                v = gl.expand_dims(_lane(wx, i), 0)
                f = _or_masked(_move(u, 8 * i, 15), 0x7F8000, one).to(gl.float32, bitcast=True)
                s += gl.sum(f * v, 2)
                xs += gl.sum(v, 2)
            d = gl.load(h + (rb + OD + chc * 2) // 2).to(gl.float32)
            acc += gl.where(ok, d * (256.0 * s - 384.0 * xs), 0.0)
        _finish(gl.sum(acc, 1), out, res, pid, N, OUTS, WARPS, SILU, RESIDUAL)

    KERNELS = {int(T.Q4_K): _q4k_kernel, int(T.Q6_K): _q6k_kernel, int(T.Q8_0): _q8_kernel}


BLOCK_VALUES = {T.Q4_K: 256, T.Q6_K: 256, T.Q8_0: 32}
PLANES = {T.Q4_K: ("OSC", "OD", "OM"), T.Q6_K: ("OH", "OSC", "OD"), T.Q8_0: ("OD",)}  # each kernel's offsets


@functools.cache
def plane_offsets(qtype: int, k: int) -> dict[str, int]:
    """The kernel's plane offsets for packed rows of k values (`blocks_decode.layout`)."""
    lay = dict(zip(("OQ", "SQ", "OH", "SH", "OSC", "SSC", "OD", "SD", "OM", "SM"),
                   layout(qtype, k // BLOCK_VALUES[qtype], True)))
    return {key: lay[key] for key in PLANES[qtype]}


def kq_gemv(x: torch.Tensor, blocks: torch.Tensor, qtype: int, *, norm_weight: torch.Tensor | None,
            eps: float, silu: bool, residual: torch.Tensor | None, out: torch.Tensor,
            config: Config | None = None) -> torch.Tensor:
    """`blocks.block_gemv`'s product (checked there) for what `takes`: writes and returns out.
    A norm runs first as its own launch (`fused.rms_norm`, the same rounding as the fold):
    measured faster than normalising the row again in every program."""
    k = x.shape[1]
    n = out.shape[1]
    if norm_weight is not None:
        x = fused.rms_norm(x, norm_weight, eps)
    rpt, tr, warps = config or default_config(n, k, qtype)
    if silu and rpt % 2:
        raise ValueError(f"kq_gemv: silu pairs a gate and an up row in one thread, not {rpt} rows")
    offsets = plane_offsets(int(qtype), k)
    rows = rpt * tr // (2 if silu else 1)
    pdl = pdl_on(x.device.index if x.device.index is not None else 0)
    KERNELS[int(qtype)][(-(-n // rows),)](
        x, blocks, blocks.view(torch.float16), out, residual if residual is not None else x, n,
        K=k, **offsets, RPT=rpt, TR=tr, WARPS=warps, SILU=silu, RESIDUAL=residual is not None,
        PDL=pdl, num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )
    return out
