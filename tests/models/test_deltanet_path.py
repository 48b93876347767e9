"""Which code runs the gated DeltaNet layers: the torch reference on the CPU and for float32
(FLA's kernels need CUDA and run bf16 / fp16 here, tests/gpu/test_gpu_deltanet.py), and the
varlen layout the FLA path reads the spans as."""

from __future__ import annotations

import sys

import pytest
import torch

from strata.models.deltanet_fla import backend_for, varlen_layout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_cpu_takes_the_torch_path_without_importing_fla(dtype: torch.dtype) -> None:
    had_fla = "fla" in sys.modules
    assert backend_for(torch.device("cpu"), dtype) == "torch"
    assert ("fla" in sys.modules) == had_fla


def test_float32_takes_the_torch_path_on_cuda_too() -> None:
    """FLA's float32 products are TF32; float32 is held to the CPU's tokens (docs/GPU.md)."""
    assert backend_for(torch.device("cuda"), torch.float32) == "torch"


def test_spans_become_cu_seqlens_with_decode_rows_apart() -> None:
    spans = ((0, 1), (1, 5), (6, 1), (7, 3))
    layout = varlen_layout(spans, torch.device("cpu"))
    assert layout.num_rows == 10
    assert layout.cu_all.tolist() == [0, 1, 6, 7, 10]
    assert layout.single.tolist() == [0, 2] and layout.single_rows.tolist() == [0, 6]
    assert layout.multi.tolist() == [1, 3] and layout.multi_rows.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert layout.cu_multi.tolist() == [0, 5, 8]


def test_prompts_alone_need_no_gather_and_decode_alone_no_chunks() -> None:
    prompts = varlen_layout(((0, 4), (4, 2)), torch.device("cpu"))
    assert prompts.single is None and prompts.multi_rows is None
    assert prompts.cu_multi.tolist() == [0, 4, 6]
    decode = varlen_layout(((0, 1), (1, 1)), torch.device("cpu"))
    assert decode.multi is None and decode.single.tolist() == [0, 1]


@pytest.mark.parametrize("spans", [((1, 2),), ((0, 2), (3, 1)), ((0, 0),)])
def test_spans_out_of_order_are_refused(spans: tuple[tuple[int, int], ...]) -> None:
    with pytest.raises(ValueError):
        varlen_layout(spans, torch.device("cpu"))
