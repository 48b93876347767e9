"""The torch dequantizers against gguf's numpy reference, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import FP16_SCALE_OFFSETS, random_blocks, reference, sample_values
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import strata.gguf.dequant as dequant_module
from strata.errors import ModelLoadError
from strata.gguf import SUPPORTED_TYPES, dequantize

T = GGMLQuantizationType

# Types gguf itself can quantize: their input comes from real values.
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
BLOCK_TYPES = sorted(FP16_SCALE_OFFSETS, key=int)
# The kernels must give the same bits wherever they run; CUDA joins when present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def run(
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, ...],
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> np.ndarray | torch.Tensor:
    """Dequantize on `device`; float32 results come back as numpy for bit comparison."""
    raw_t = torch.from_numpy(np.ascontiguousarray(raw)).to(device)
    out = dequantize(raw_t, ggml_type, shape, dtype)
    assert out.shape == shape and out.device == raw_t.device and out.dtype == dtype
    return out.cpu().numpy() if dtype == torch.float32 else out.cpu()


def test_supported_types_cover_the_required_set() -> None:
    required = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}
    required |= {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
    assert required <= SUPPORTED_TYPES


def shapes_for(ggml_type: GGMLQuantizationType) -> list[tuple[int, ...]]:
    """Round shapes, odd row counts, a vector and a 3-D tensor."""
    bs = GGML_QUANT_SIZES[ggml_type][0]
    return [(64, 2 * bs), (7, 3 * bs), (1, bs), (5 * bs,), (3, 5, bs)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_values_match_reference(ggml_type: GGMLQuantizationType, device: str) -> None:
    rng = np.random.default_rng(int(ggml_type))
    for shape in shapes_for(ggml_type):
        values = sample_values(rng, shape)
        raw = gguf.quants.quantize(values, ggml_type).view(np.uint8)
        ours = run(raw, ggml_type, shape, device)
        assert same_bits(ours, reference(raw, ggml_type, shape)), shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_reference(ggml_type: GGMLQuantizationType, device: str) -> None:
    rng = np.random.default_rng(100 + int(ggml_type))
    bs = GGML_QUANT_SIZES[ggml_type][0]
    for rows, blocks_per_row in [(64, 4), (7, 3), (1, 1), (33, 2)]:
        raw = random_blocks(rng, ggml_type, rows * blocks_per_row)
        shape = (rows, blocks_per_row * bs)
        ours = run(raw, ggml_type, shape, device)
        ref = reference(raw, ggml_type, shape)
        assert np.isfinite(ref).all()
        assert same_bits(ours, ref), shape


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_chunk_boundaries_do_not_change_results(
    ggml_type: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(7)
    bs = GGML_QUANT_SIZES[ggml_type][0]
    raw = random_blocks(rng, ggml_type, 37)
    shape = (37 * bs,)
    whole = run(raw, ggml_type, shape)
    # A chunk of 3 blocks leaves a short last chunk (37 = 12 * 3 + 1).
    monkeypatch.setattr(dequant_module, "_CPU_CHUNK_VALUES", 3 * bs)
    monkeypatch.setattr(dequant_module, "_GPU_CHUNK_VALUES", 3 * bs)
    for device in DEVICES:
        assert same_bits(run(raw, ggml_type, shape, device), whole), device
    assert same_bits(whole, reference(raw, ggml_type, shape))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "ggml_type", [T.F32, T.BF16, T.Q8_0, T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name
)
def test_other_dtypes_are_one_rounding_of_float32(
    ggml_type: GGMLQuantizationType, dtype: torch.dtype, device: str
) -> None:
    rng = np.random.default_rng(3)
    bs = GGML_QUANT_SIZES[ggml_type][0]
    shape = (9, 2 * bs)
    if ggml_type in FP16_SCALE_OFFSETS:
        raw = random_blocks(rng, ggml_type, 18)
    else:
        raw = gguf.quants.quantize(sample_values(rng, shape), ggml_type).view(np.uint8)
    ours = run(raw, ggml_type, shape, device, dtype)
    expected = torch.from_numpy(reference(raw, ggml_type, shape)).to(dtype)
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))


def test_result_is_a_new_tensor() -> None:
    raw = torch.from_numpy(np.arange(8, dtype=np.float32).view(np.uint8).copy())
    out = dequantize(raw, T.F32, (2, 4))
    out.add_(1.0)
    assert torch.equal(raw.view(torch.float32), torch.arange(8, dtype=torch.float32))


def test_unsupported_type_names_tensor_and_type() -> None:
    raw = torch.zeros(GGML_QUANT_SIZES[T.IQ2_XXS][1], dtype=torch.uint8)
    with pytest.raises(ModelLoadError) as err:
        dequantize(raw, T.IQ2_XXS, (256,), name="blk.3.ffn_up.weight")
    assert "blk.3.ffn_up.weight" in str(err.value)
    assert "IQ2_XXS" in str(err.value)


def test_byte_count_must_match_shape() -> None:
    raw = torch.zeros(GGML_QUANT_SIZES[T.Q8_0][1] * 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(raw, T.Q8_0, (3, 32))
    with pytest.raises(ValueError):
        dequantize(raw, T.Q8_0, (48,))  # not a whole number of blocks
