"""Shared helpers for the GGUF tests: reference dequantization and tiny files."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.default_model import default_model_path
from strata.gguf import GGUFFile
from tests.gguf_writer import add_fields, finish

T = GGMLQuantizationType

# Byte offsets of the fp16 scale fields in each block type: random bytes there
# could be NaN or inf, which the reference and torch may encode differently.
FP16_SCALE_OFFSETS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def reference(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: Iterable[int]) -> np.ndarray:
    """gguf's numpy dequantization of uint8 bytes, as float32 in `shape`."""
    data = raw.reshape(-1)
    if ggml_type == T.F32:
        data = data.view(np.float32)
    elif ggml_type == T.F16:
        data = data.view(np.float16)
    else:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        data = data.reshape(-1, type_size)
    out = gguf.quants.dequantize(data, ggml_type)
    return np.asarray(out, dtype=np.float32).reshape(tuple(shape))


def random_blocks(
    rng: np.random.Generator, ggml_type: GGMLQuantizationType, n_blocks: int
) -> np.ndarray:
    """Random block bytes with finite fp16 scales: every quant bit pattern occurs."""
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in FP16_SCALE_OFFSETS[ggml_type]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def sample_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Weights-like float32 values, with one all-zero row (the zero-scale case)."""
    values = (rng.standard_normal(shape) * rng.uniform(0.01, 2.0, size=shape[:-1] + (1,)))
    values = values.astype(np.float32)
    values.reshape(-1, shape[-1])[0] = 0.0
    return values


WriteGGUF = Callable[..., Path]


@pytest.fixture
def write_gguf(tmp_path: Path) -> WriteGGUF:
    """Write a small GGUF: tensors are (name, array, raw_dtype or None) triples."""

    def write(
        name: str = "tiny.gguf",
        tensors: Iterable[tuple[str, np.ndarray, GGMLQuantizationType | None]] = (),
        metadata: dict[str, Any] | None = None,
        arch: str = "llama",
        **writer_options: Any,
    ) -> Path:
        path = tmp_path / name
        writer = gguf.GGUFWriter(path, arch, **writer_options)
        add_fields(writer, metadata or {}, int64=True)
        for tensor_name, array, raw_dtype in tensors:
            writer.add_tensor(tensor_name, array, raw_dtype=raw_dtype)
        finish(writer)
        return path

    return write


@pytest.fixture(scope="session")
def default_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def default_file(default_path: Path) -> GGUFFile:
    return GGUFFile(default_path)

