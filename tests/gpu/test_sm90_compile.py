"""Every kernel variant the engine launches compiles for sm_90, without a GPU (Triton needed).

Catches what only the device would otherwise show: a Triton pass that
rejects a kernel, register spills in the decode and write kernels, and the
write kernels' arithmetic (IEEE division, no fused multiply-adds, kept
round-to-nearest-even additions) that makes them bit-identical to torch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import os
import re

import torch

from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.triton.decode import DecodeBatch, decode_attention
from strata.kv.triton.layout import halves
from strata.kv.triton.prefill import PrefillBatch, prefill_attention
from strata.kv.triton.write import write_plain, write_quantized
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
                         1024, 0.1, 132, rot)
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
