"""What a block kernel compiles to on sm_90, without a GPU (JSON).

The device is scarce; the compiled code is not. Triton's wheel ships ptxas,
cuobjdump and nvdisasm, so a kernel can be compiled for Hopper on any
machine and its machine code read: registers, spilled bytes, and the
instructions of its main loop by opcode. For the one-row products the loop's
instructions per weight bounds the speed where the memory does not, so two
variants can be compared before a device run (docs/PERFORMANCE.md used it
for `kernels/triton/kquant_rows.py`).

    pip install --target /tmp/tri triton==3.6.0   # a CPU machine: Triton only for this
    PYTHONPATH=/tmp/tri:$PWD python -m tools.kernel_sass --qtype Q4_K --rows 4096 --cols 14336 --residual
    python -m tools.kernel_sass --kernel decode --qtype Q4_K --rows 14336 --cols 4096 --silu
    python -m tools.kernel_sass --kernel mm --m 16 --qtype Q6_K --rows 28672 --cols 4096
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

from gguf import GGMLQuantizationType as T


def _binary(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(fn: Any, signature: dict[str, str], constants: dict[str, Any], warps: int,
                 gluon: bool) -> Any:
    """The kernel compiled for sm_90 (pointer arguments taken as 16-byte aligned, as Triton's
    launcher specializes them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({k: "constexpr" for k in constants})
    pointers = [i for i, t in enumerate(signature.values()) if t.startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        src: Any = GluonASTSource(fn, sig, constants, attrs)
    else:
        src = ASTSource(fn, sig, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def _instructions(sass: str) -> list[tuple[int, str]]:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the kernel's main loop); the whole
    kernel where there is no loop (one pass over the row)."""
    labels: dict[str, int] = {}
    pending = None
    for line in sass.splitlines():
        m = re.match(r"\.L_x_(\d+):", line.strip())
        if m:
            pending = m.group(1)
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", line)
        if m and pending is not None:
            labels[pending], pending = int(m.group(1), 16), None
    ins = _instructions(sass)
    best = None
    for at, text in ins:
        m = re.search(r"BRA.*\.L_x_(\d+)", text)
        if m and m.group(1) in labels and labels[m.group(1)] < at:
            span = (labels[m.group(1)], at)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        return [t for _, t in ins]
    return [t for at, t in ins if best[0] <= at <= best[1]]


def report(kernel: Any, weights_per_loop: int) -> dict[str, Any]:
    """Registers, spilled bytes and the main loop's instructions (per weight a thread holds)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([_binary("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([_binary("nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    loop = main_loop(sass)
    ops = collections.Counter(_opcode(t) for t in loop)
    return {"registers": int(m.group(1)) if m else None, "stack_bytes": int(m.group(2)) if m else None,
            "loop_instructions": len(loop), "per_weight": round(len(loop) / weights_per_loop, 2),
            "opcodes": dict(ops.most_common(12))}


def block_rows(kernel: str, qtype: int, rows: int, cols: int, silu: bool, residual: bool,
               config: tuple[int, ...] | None) -> dict[str, Any]:
    """`kquant_rows`' group-sum kernel (kernel="group") or `blocks._gemv_kernel` (kernel=
    "decode") for one matrix, as block_gemv would launch it for packed blocks."""
    from strata.kernels.triton import blocks, kquant_rows
    from strata.kernels.triton.blocks_decode import TYPES

    n = rows // 2 if silu else rows
    nb = cols // TYPES[qtype].block
    sig = {"x": "*bf16", "b": "*u8", "h": "*fp16", "out": "*bf16", "res": "*bf16"}
    if kernel == "group":
        rpt, tr, warps = config or kquant_rows.default_config(n, cols, qtype)
        consts = dict(K=cols, **kquant_rows.plane_offsets(qtype, cols), RPT=rpt, TR=tr, WARPS=warps,
                      SILU=silu, RESIDUAL=residual, PDL=True)
        compiled = compile_sm90(kquant_rows.KERNELS[qtype], {**sig, "N": "i32"}, consts, warps, gluon=True)
        per_thread = rpt * (32 if qtype == T.Q8_0 else 64)  # a thread's chunk of each of its rows
        shape = {"rows_a_thread": rpt, "threads_along_rows": tr, "warps": warps}
    else:
        bn, per, warps, _ = config or blocks.default_gemv_config(n, cols, qtype, silu)
        consts = dict(K=cols, **blocks._type_args(qtype, nb, True), BLOCK_N=bn, G=per * TYPES[qtype].groups,
                      NORM=False, NORM_BLOCK=1, SILU=silu, RESIDUAL=residual, PDL=True)
        compiled = compile_sm90(blocks._gemv_kernel, {**sig, "nw": "*bf16", "eps": "fp32", "N": "i32"},
                                consts, warps, gluon=False)
        parts = bn * (2 if silu else 1)
        per_thread = parts * per * TYPES[qtype].block // (32 * warps)
        shape = {"block_n": bn, "blocks_a_step": per, "warps": warps}
    return {"kernel": kernel, "type": T(qtype).name, "rows": rows, "cols": cols, "silu": silu,
            "residual": residual, **shape, **report(compiled, per_thread)}


def block_mm(qtype: int, m: int, rows: int, cols: int, config: tuple[int, ...] | None) -> dict[str, Any]:
    """`blocks._mm_kernel` for M rows of bf16 input, as block_mm would launch it for packed blocks;
    per weight: the instructions of its loop over the weights a thread decodes there."""
    from strata.kernels.triton import blocks
    from strata.kernels.triton.blocks_decode import TYPES

    nb = cols // TYPES[qtype].block
    bm, bn, per, warps, _ = config or blocks.default_mm_config(m, rows, cols, qtype)
    consts = dict(K=cols, **blocks._type_args(qtype, nb, True), BLOCK_M=bm, BLOCK_N=bn,
                  G=per * TYPES[qtype].groups, PRECISION="tf32")
    sig = {"x": "*bf16", "b": "*u8", "h": "*fp16", "out": "*bf16", "M": "i32", "N": "i32"}
    compiled = compile_sm90(blocks._mm_kernel, sig, consts, warps, gluon=False)
    per_thread = bn * per * TYPES[qtype].block // (32 * warps)
    return {"kernel": "mm", "type": T(qtype).name, "m": m, "rows": rows, "cols": cols, "block_m": bm,
            "block_n": bn, "blocks_a_step": per, "warps": warps, **report(compiled, per_thread)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel", choices=["group", "decode", "mm"], default="group",
                   help="group: kquant_rows' group sums; decode: blocks._gemv_kernel; mm: "
                        "blocks._mm_kernel for --m rows")
    p.add_argument("--m", type=int, default=16, help="input rows of --kernel mm")
    p.add_argument("--qtype", default="Q4_K")
    p.add_argument("--rows", type=int, default=4096, help="weight rows (gate and up together with --silu)")
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--silu", action="store_true")
    p.add_argument("--residual", action="store_true")
    p.add_argument("--config", default="", help="comma-separated launch shape (the kernel's Config)")
    a = p.parse_args(argv)
    config = tuple(int(v) for v in a.config.split(",")) if a.config else None
    qtype = int(T[a.qtype])
    if a.kernel == "mm":
        print(json.dumps(block_mm(qtype, a.m, a.rows, a.cols, config)))
    else:
        print(json.dumps(block_rows(a.kernel, qtype, a.rows, a.cols, a.silu, a.residual, config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
