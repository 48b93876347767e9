"""GGUFFile on small written files and on the embedded default model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import WriteGGUF, random_blocks, reference
from gguf import GGMLQuantizationType

from strata.gguf import GGUFFile, TensorInfo

T = GGMLQuantizationType


@pytest.fixture
def tiny(write_gguf: WriteGGUF) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    arrays = {
        "norm.weight": rng.standard_normal(64).astype(np.float32),
        "proj.weight": rng.standard_normal((3, 64)).astype(np.float32),
        "half.weight": rng.standard_normal((5, 32)).astype(np.float16),
        "q8.weight": gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0),
        "q4k.weight": random_blocks(rng, T.Q4_K, 6).reshape(3, -1),
    }
    types = {"q8.weight": T.Q8_0, "q4k.weight": T.Q4_K}
    path = write_gguf(
        tensors=[(name, a, types.get(name)) for name, a in arrays.items()],
        metadata={
            "general.name": "tiny",
            "llama.block_count": 2,
            "llama.rope.freq_base": 10000.0,
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.tokens": ["<s>", "a", "é", "ab"],
            "tokenizer.ggml.token_type": [3, 1, 1, 1],
            "tokenizer.ggml.scores": [0.0, -1.5, -2.0, -3.25],
        },
    )
    return path, arrays


def test_metadata_is_plain_python(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    f = GGUFFile(tiny[0])
    md = f.metadata
    assert f.architecture == "llama" == md["general.architecture"]
    assert md["general.name"] == "tiny"
    assert md["llama.block_count"] == 2 and type(md["llama.block_count"]) is int
    assert md["llama.rope.freq_base"] == 10000.0 and type(md["llama.rope.freq_base"]) is float
    assert md["tokenizer.ggml.add_bos_token"] is True
    assert md["tokenizer.ggml.tokens"] == ["<s>", "a", "é", "ab"]
    assert md["tokenizer.ggml.token_type"] == [3, 1, 1, 1]
    assert all(type(v) is int for v in md["tokenizer.ggml.token_type"])
    assert md["tokenizer.ggml.scores"] == [0.0, -1.5, -2.0, -3.25]
    assert not any(key.startswith("GGUF.") for key in md)


def test_agrees_with_plain_gguf_reader(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    # GGUFFile reads through a GGUFReader subclass; it must see what the original sees.
    plain = gguf.GGUFReader(tiny[0])
    f = GGUFFile(tiny[0])
    expected = {k: v.contents() for k, v in plain.fields.items() if not k.startswith("GGUF.")}
    assert f.metadata == expected
    assert [t.name for t in plain.tensors] == list(f.tensors)
    for t in plain.tensors:
        info = f.tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.nbytes == t.n_bytes
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert f.raw(t.name).tobytes() == t.data.tobytes()


def test_tensor_infos_use_torch_order(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    f = GGUFFile(tiny[0])
    assert list(f.tensors) == list(tiny[1])
    assert f.tensors["proj.weight"] == TensorInfo("proj.weight", (3, 64), T.F32, 3 * 64 * 4)
    assert f.tensors["half.weight"].shape == (5, 32)
    assert f.tensors["half.weight"].type_name == "F16"
    assert f.tensors["q8.weight"].shape == (4, 64)
    assert f.tensors["q8.weight"].nbytes == 4 * 2 * 34
    assert f.tensors["q4k.weight"].shape == (3, 512)
    assert f.tensors["q4k.weight"].ggml_type == T.Q4_K


def test_load_matches_written_values(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, arrays = tiny
    f = GGUFFile(path)
    for name in ("norm.weight", "proj.weight", "half.weight"):
        expected = torch.from_numpy(arrays[name].astype(np.float32))
        assert torch.equal(f.load(name), expected), name
    for name in ("q8.weight", "q4k.weight"):
        info = f.tensors[name]
        expected = torch.from_numpy(reference(arrays[name], info.ggml_type, info.shape))
        assert torch.equal(f.load(name, device=torch.device("cpu")), expected), name
    bf = f.load("proj.weight", dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf, torch.from_numpy(arrays["proj.weight"]).to(torch.bfloat16))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_load_on_device(tiny: tuple[Path, dict[str, np.ndarray]], device: str) -> None:
    f = GGUFFile(tiny[0])
    for name in f.tensors:
        t = f.load(name, device=device, dtype=torch.bfloat16)
        assert t.device.type == device
        assert torch.equal(t.cpu(), f.load(name).to(torch.bfloat16)), name


def test_raw_is_the_stored_bytes(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, arrays = tiny
    f = GGUFFile(path)
    for name, array in arrays.items():
        raw = f.raw(name)
        assert raw.dtype == np.uint8 and raw.ndim == 1
        assert raw.tobytes() == array.tobytes(), name


def test_loaded_tensors_do_not_alias_the_file(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, arrays = tiny
    f = GGUFFile(path)
    f.load("proj.weight").zero_()
    assert f.raw("proj.weight").tobytes() == arrays["proj.weight"].tobytes()


def test_identity_follows_names_shapes_and_types(write_gguf: WriteGGUF) -> None:
    a = np.ones((4, 32), dtype=np.float32)
    first = GGUFFile(write_gguf("a.gguf", [("w", a, None)])).identity()
    assert len(first) == 64 and int(first, 16) >= 0
    same_layout = GGUFFile(write_gguf("b.gguf", [("w", a * 2, None)])).identity()
    other_shape = GGUFFile(write_gguf("c.gguf", [("w", a.reshape(8, 16), None)])).identity()
    other_type = GGUFFile(write_gguf("d.gguf", [("w", a.astype(np.float16), None)])).identity()
    other_name = GGUFFile(write_gguf("e.gguf", [("v", a, None)])).identity()
    assert first == same_layout
    assert len({first, other_shape, other_type, other_name}) == 4


# The embedded model (SmolLM2-135M-Instruct, Q4_1).


def test_default_model_header(default_file: GGUFFile) -> None:
    f = default_file
    assert len(f.tensors) == 272
    assert f.architecture == "llama"
    assert f.metadata["general.architecture"] == "llama"
    assert f.metadata["llama.block_count"] == 30
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and all(isinstance(t, str) for t in tokens[:100])
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert isinstance(f.metadata["tokenizer.chat_template"], str)
    assert f.tensors["token_embd.weight"].shape == (49152, 576)
    assert f.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert f.tensors["blk.0.ffn_gate.weight"].shape == (1536, 576)
    assert f.tensors["blk.0.attn_k.weight"].shape == (192, 576)
    assert {i.type_name for i in f.tensors.values()} == {"F32", "Q4_1", "Q8_0"}
    # Session files store this value: a change to identity() must be deliberate.
    assert f.identity() == "7f14da48a0ba2845400f2947a0a4340267176f617bbe1cc49916899d309cd56c"


@pytest.mark.parametrize(
    "name", ["blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"]
)
def test_default_model_tensors_match_reference(default_file: GGUFFile, name: str) -> None:
    info = default_file.tensors[name]
    expected = reference(default_file.raw(name), info.ggml_type, info.shape)
    assert torch.equal(default_file.load(name), torch.from_numpy(expected))


def test_default_model_embedding_rows_match_reference(default_file: GGUFFile) -> None:
    info = default_file.tensors["token_embd.weight"]
    assert info.type_name == "Q8_0"
    rows = default_file.load("token_embd.weight", dtype=torch.bfloat16)
    assert rows.shape == (49152, 576) and rows.dtype == torch.bfloat16
    row_bytes = info.nbytes // info.shape[0]
    picked = [0, 1, 2, 12345, 49151]
    for row in picked:
        raw = default_file.raw("token_embd.weight")[row * row_bytes : (row + 1) * row_bytes]
        expected = torch.from_numpy(reference(raw, info.ggml_type, (576,))).to(torch.bfloat16)
        assert torch.equal(rows[row], expected), row


def test_default_model_every_tensor_loads(default_file: GGUFFile) -> None:
    for name, info in default_file.tensors.items():
        t = default_file.load(name, dtype=torch.bfloat16)
        assert tuple(t.shape) == info.shape and t.dtype == torch.bfloat16, name
