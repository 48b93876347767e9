"""Every bad input gives a ModelLoadError that names the file and the problem."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WriteGGUF
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian
from gguf import quants as gguf_quants

from strata.errors import ModelLoadError
from strata.gguf import GGUFFile

T = GGMLQuantizationType


def open_error(path: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as err:
        GGUFFile(path)
    message = str(err.value)
    assert str(path) in message and err.value.path == str(path)
    assert "\n" not in message
    return err.value


def small_file(write_gguf: WriteGGUF, name: str = "small.gguf") -> Path:
    w = np.arange(4 * 32, dtype=np.float32).reshape(4, 32)
    return write_gguf(name, [("a.weight", w, None), ("b.weight", w[:2].copy(), None)])


def test_missing_file(tmp_path: Path) -> None:
    assert "not found" in open_error(tmp_path / "absent.gguf").problem


def test_directory(tmp_path: Path) -> None:
    assert "not a regular file" in open_error(tmp_path).problem


@pytest.mark.parametrize(
    "content", [b"", b"GG", b"hello, this is a text file\n", b"PK\x03\x04" * 64]
)
def test_not_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert "not a GGUF file" in open_error(path).problem


def test_default_model_cut_in_tensor_data(tmp_path: Path, default_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    with default_path.open("rb") as src:
        path.write_bytes(src.read(default_path.stat().st_size // 2))
    err = open_error(path)
    assert "truncated" in err.problem and "tensor data" in err.problem


def test_default_model_cut_in_header(tmp_path: Path, default_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    with default_path.open("rb") as src:
        path.write_bytes(src.read(100_000))
    assert "header runs past the end" in open_error(path).problem


def test_one_byte_short(tmp_path: Path, write_gguf: WriteGGUF) -> None:
    data = small_file(write_gguf).read_bytes()
    path = tmp_path / "short.gguf"
    path.write_bytes(data[:-1])
    assert "truncated" in open_error(path).problem


def test_unknown_version(tmp_path: Path, write_gguf: WriteGGUF) -> None:
    data = bytearray(small_file(write_gguf).read_bytes())
    data[4:8] = struct.pack("<I", 99)
    path = tmp_path / "v99.gguf"
    path.write_bytes(bytes(data))
    assert "corrupt GGUF header" in open_error(path).problem


def test_unknown_tensor_type(tmp_path: Path, write_gguf: WriteGGUF) -> None:
    data = bytearray(small_file(write_gguf).read_bytes())
    # Tensor info: name (u64 length + bytes), n_dims u32, dims u64 each, type u32, offset u64.
    at = data.index(b"b.weight") + len(b"b.weight")
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == int(T.F32)
    struct.pack_into("<I", data, type_at, 250)
    path = tmp_path / "badtype.gguf"
    path.write_bytes(bytes(data))
    assert "corrupt GGUF header" in open_error(path).problem


def test_absurd_string_length(tmp_path: Path, write_gguf: WriteGGUF) -> None:
    data = bytearray(small_file(write_gguf).read_bytes())
    # The first key follows magic, version and the two counts.
    struct.pack_into("<Q", data, 4 + 4 + 8 + 8, 1 << 60)
    path = tmp_path / "badlen.gguf"
    path.write_bytes(bytes(data))
    assert "header runs past the end" in open_error(path).problem


def test_big_endian_file(write_gguf: WriteGGUF) -> None:
    w = np.ones((2, 32), dtype=np.float32)
    path = write_gguf("be.gguf", [("w", w, None)], endianess=GGUFEndian.BIG)
    assert "big-endian" in open_error(path).problem


def test_foreign_tensor_type_loads_through_gguf_quants(write_gguf: WriteGGUF) -> None:
    """A type only gguf.quants decodes (IQ2_XXS) loads with its values, not a refusal."""
    _, type_size = GGML_QUANT_SIZES[T.IQ2_XXS]
    raw = np.random.default_rng(0).integers(0, 256, (2, type_size), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)  # a finite scale
    path = write_gguf("iq.gguf", [("blk.0.attn_q.weight", raw, T.IQ2_XXS)])
    f = GGUFFile(path)
    assert f.tensors["blk.0.attn_q.weight"].type_name == "IQ2_XXS"
    assert f.raw("blk.0.attn_q.weight").nbytes == 2 * type_size
    got = f.load("blk.0.attn_q.weight")
    want = gguf_quants.dequantize(raw, T.IQ2_XXS).reshape(2, -1)
    assert got.shape == (2, 256) and torch.equal(got, torch.from_numpy(want))
    assert got.abs().sum() > 0


def test_unsupported_tensor_type(write_gguf: WriteGGUF) -> None:
    _, type_size = GGML_QUANT_SIZES[T.Q8_K]  # no decoder anywhere: an intermediate type of ggml's
    raw = np.zeros((2, type_size), dtype=np.uint8)
    path = write_gguf("q8k.gguf", [("blk.0.attn_q.weight", raw, T.Q8_K)])
    f = GGUFFile(path)
    with pytest.raises(ModelLoadError) as err:
        f.load("blk.0.attn_q.weight")
    message = str(err.value)
    assert str(path) in message and "blk.0.attn_q.weight" in message and "Q8_K" in message


def test_unknown_tensor_name(write_gguf: WriteGGUF) -> None:
    path = small_file(write_gguf)
    f = GGUFFile(path)
    for call in (f.load, f.raw):
        with pytest.raises(ModelLoadError) as err:
            call("c.weight")
        assert str(path) in str(err.value) and "c.weight" in str(err.value)
