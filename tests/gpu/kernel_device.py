"""Where the kernel tests run: the CUDA device, or (opt-in) the CPU under Triton's interpreter.

`STRATA_TRITON_INTERPRET=1` runs the Triton kernels on CPU tensors through
`TRITON_INTERPRET=1` (slow, numpy underneath), so their arithmetic can be
checked on a machine without a GPU. Without it and without CUDA, or without
Triton, the kernel tests skip. Import this module before any Triton kernel
is defined: the interpreter is chosen when `triton.jit` decorates.
"""

from __future__ import annotations

import os

import pytest

INTERPRET = os.environ.get("STRATA_TRITON_INTERPRET") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")
import numpy as np
import torch


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch and the GPU do (NaN aside)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _patch_interpreter_bf16() -> None:
    """Teach the interpreter bfloat16 arithmetic (Triton 3.6 keeps bf16 as raw uint16).

    As shipped it truncates float32 -> bf16, converts ints and fp16 to bf16 as
    if bf16 were an integer type, and multiplies raw bf16 bits in `tl.dot`.
    These kernels only convert to and from bf16 and feed it to `tl.dot`, so
    those three operations are enough.
    """
    import triton.language as tl
    from triton.runtime import interpreter as it

    builder = it.InterpreterBuilder
    if getattr(builder, "_strata_bf16", False):
        return

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s != tl.bfloat16 and d != tl.bfloat16:
            return it.TensorHandle(src.data.astype(it._get_np_dtype(dst_type)), d)
        x = _bf16_to_f32(src.data) if s == tl.bfloat16 else src.data.astype(np.float32)
        out = _f32_to_bf16(x) if d == tl.bfloat16 else x.astype(it._get_np_dtype(dst_type))
        return it.TensorHandle(out.reshape(src.data.shape), d)

    plain_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = it.TensorHandle(_bf16_to_f32(a.data), tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = it.TensorHandle(_bf16_to_f32(b.data), tl.float32)
        return plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui",
                 "create_fp_ext", "create_fp_trunc"):
        setattr(builder, name, lambda self, src, dst_type: cast_impl(self, src, dst_type))
    builder.cast_impl = cast_impl
    builder.create_dot = create_dot
    builder._strata_bf16 = True


if INTERPRET:
    _patch_interpreter_bf16()


def kernel_device() -> str:
    """"cuda", "cpu" under the interpreter, or skip the calling module."""
    if INTERPRET:
        # the device functions every kernel module builds on (decode and prefill on cells,
        # fused and gemv on numerics): defined compiled, the kernels above them are too
        from strata.kernels.triton import cells, numerics

        if any(type(f).__name__ != "InterpretedFunction" for f in (cells.cells_of, numerics.exp)):
            pytest.skip("kernels were compiled before STRATA_TRITON_INTERPRET took effect: "
                        "set TRITON_INTERPRET=1 too", allow_module_level=True)
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (or STRATA_TRITON_INTERPRET=1)", allow_module_level=True)
    return "cuda"
