"""Every kernel variant the engine launches compiles for sm_90, without a GPU (Triton needed).

Catches what only the device would otherwise show: a Triton pass that
rejects a kernel, register spills in the decode and write kernels, and the
write kernels' arithmetic (IEEE division, no fused multiply-adds, kept
round-to-nearest-even additions) that makes them bit-identical to torch;
the same for the row-wise kernels of `strata/kernels/triton/fused.py`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import os
import re

import torch
import triton

from strata.kernels.triton import fused
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kernels.triton.decode import Q4_0_MAXNREG, DecodeBatch, decode_attention
from strata.attention.layout import halves
from strata.kernels.triton.prefill import PrefillBatch, prefill_attention
from strata.kernels.triton.write import write_plain, write_quantized
from tests.gpu.sm90 import compile_sm90, launches

if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
    pytest.skip("kernels are interpreted here, or a GPU compiles them for real",
                allow_module_level=True)


def _launch_all(fmt: str) -> list:
    pool = KvPool(make_format(fmt, 8, 128), 1, 1, 4096, 1024, None, "cpu")
    kh, vh = halves(pool.fmt, pool.layers[0])
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    i = torch.zeros(1, dtype=torch.int64)
    rot = fmt == "k8v4"

    def run() -> None:
        decode_attention(q, out, DecodeBatch(i, i, i + 4000, 32768), kh, vh, pool.tables_device,
                         1024, 0.1, rot)
        prefill_attention(q, out, PrefillBatch(i, i, i, i, i + 1, i), kh, vh, pool.tables_device,
                          1024, 0.1, rot)
        if fmt == "bf16":
            write_plain(kh.data, vh.data, i, kv, kv)
        else:
            write_quantized(kh, vh, i, kv, kv, rot)

    return [compile_sm90(r) for r in launches(run)]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q4_0", "k8v4"])
def test_kernels_compile_for_sm90(fmt: str) -> None:
    built = {k.name: k for k in _launch_all(fmt)}
    assert {"_decode_kernel", "_combine_kernel", "_prefill_kernel"} <= set(built)
    assert built["_decode_kernel"].spill_bytes <= 32, built["_decode_kernel"]
    if fmt != "bf16":
        w = built["_write_quant_kernel"]
        assert w.spill_bytes == 0
        assert "div.rn.f32" in w.ptx and "div.full.f32" not in w.ptx
        assert not re.search(r"\bfma\.", w.ptx)
        if fmt != "q4_0":  # int8 codes: round half to even through 1.5 * 2**23
            assert "0f4B400000" in w.ptx and "0fCB400000" in w.ptx


@pytest.mark.parametrize("fmt", ["q4_0", "k8v4"])
def test_q4_0_decode_compiles_without_spills_under_its_register_cap(
        fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode kernel reading Q4_0 (8B heads, bf16) within `Q4_0_MAXNREG` registers."""
    plain = triton.compile  # the launch's maxnreg does not reach the recorded request
    monkeypatch.setattr(triton, "compile", lambda src, target=None, options=None: plain(
        src, target=target, options={**options, "maxnreg": Q4_0_MAXNREG}))
    k = {c.name: c for c in _launch_all(fmt)}["_decode_kernel"]
    print(f"{fmt}: {k.registers} registers, {k.spill_bytes} bytes spilled")
    assert k.spill_bytes == 0, k.registers


# (hidden, intermediate, q heads, kv heads, head_dim): the 8B shape, the default model's, and a
# hidden size past one norm tile (the looping variant)
FUSED_SHAPES = [(4096, 14336, 32, 8, 128), (576, 1536, 9, 3, 64),
                (fused.NORM_BLOCK + 300, 1000, 3, 1, 80)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_fused_kernels_compile_for_sm90(dtype: torch.dtype) -> None:
    def run() -> None:
        for n, i, hq, hkv, d in FUSED_SHAPES:
            x = torch.zeros(2, n, dtype=dtype)
            w = torch.zeros(n, dtype=dtype)
            fused.rms_norm(x, w, 1e-5)
            fused.add_rms_norm(x, x, w, 1e-5)
            cos = torch.zeros(2, 1, d, dtype=dtype)
            fused.rope_qkv(torch.zeros(2, (hq + 2 * hkv) * d, dtype=dtype), cos, cos, hq, hkv, d)
            fused.silu_mul(torch.zeros(2, 2 * i, dtype=dtype))

    built = [compile_sm90(r) for r in launches(run)]
    assert len(built) == 4 * len(FUSED_SHAPES)
    for k in built:
        assert k.spill_bytes == 0, k
        if k.name == "_rope_kernel":  # bit-identical to torch: every product and sum rounded
            assert not re.search(r"\bfma\.", k.ptx)
        if k.name == "_rms_kernel":  # IEEE mean and 1 / sqrt
            assert "div.rn.f32" in k.ptx and "sqrt.rn.f32" in k.ptx and "div.full.f32" not in k.ptx
        if k.name == "_silu_mul_kernel":  # IEEE division; libdevice's expf (its own fma range
            assert "div.rn.f32" in k.ptx and "div.full.f32" not in k.ptx  # reduction before ex2)
            assert re.search(r"\bfma\.rn", k.ptx)


def test_moe_router_compiles_for_sm90() -> None:
    """The fused router (`kernels/triton/route.py`) of a 128-expert, top-8 layer: no spills."""
    from strata.kernels.triton import route

    logits = torch.zeros(2, 128, dtype=torch.bfloat16)  # on the CPU: launched directly, not through `route`
    ids, w = torch.empty(2, 8, dtype=torch.int64), torch.empty(2, 8, dtype=torch.bfloat16)
    built = [compile_sm90(r) for r in launches(lambda: route._route_kernel[(2,)](
        logits, ids, w, E=128, EP=128, K=8, KP=8, NORMALISE=True, num_warps=4))]
    assert [k.name for k in built] == ["_route_kernel"] and built[0].spill_bytes == 0
