"""Random-weight GGUF files in real model shapes, for speed measurements without downloads.

Speed does not depend on weight values, so a file with random bf16 weights
in the Llama-3.1-8B shape measures what the real model would, provided the
values are not zeros (zeros can run faster) and stay small enough that
activations remain finite. The tokenizer metadata (vocabulary, merges, chat
template) is copied from a real GGUF, so prompts and text stay realistic and
the vocabulary sets the embedding and output sizes.

Writing is I/O-bound: one pool of random bf16 values is drawn once and every
tensor is written as slices of it at random offsets, so a 15 GB file costs
about what the disk needs, not minutes of random number generation.

    python -m tools.synth OUT.gguf [--shape llama-3.1-8b|llama-3.1-70b|llama-3.2-1b|tiny|tiny-4]
        [--tokenizer-from GGUF] [--quant bf16|Q4_K_M|Q6_K|Q8_0|Q4_0|Q4_1|Q5_K]

Quantized files (`--quant`) are written the same way from a pool of random
blocks whose scale fields are set to finite values of the right size (the
codes are random bytes): `Q4_K_M` follows llama.cpp's recipe for that name
(Q4_K, with Q6_K for the output, and for attn_v and ffn_down on the layers
llama.cpp gives more bits), the others put every matrix in that type.
    python -m tools.synth OUT.gguf --tokenizer-only   # the tokenizer metadata alone (a few MB)
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

ALIGN = 32
# GGUF metadata value types and ggml tensor types (the GGUF v3 specification)
U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
GGML_F32, GGML_BF16 = 0, 30
FILE_TYPE_BF16 = 32  # general.file_type: mostly bf16
# llama.cpp's general.file_type numbers (llama_ftype) for the --quant choices
FILE_TYPES = {"bf16": FILE_TYPE_BF16, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q5_K": 17, "Q6_K": 18}


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions (Llama layout: untied output, SwiGLU, grouped-query attention)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    context: int = 131072
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "llama-3.1-8b": Shape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8),
    "llama-3.2-1b": Shape(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8),
    "llama-3.1-70b": Shape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8),
    "tiny": Shape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, context=4096),
    "tiny-4": Shape(layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, context=4096),  # room to split
}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K for attn_v and ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: Shape, vocab: int, quant: str = "bf16") -> list[tuple[str, tuple[int, ...], int]]:
    """(name, torch-order shape, ggml type) of every tensor, in file order."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    q4km = quant == "Q4_K_M"
    base = GGML_BF16 if quant == "bf16" else int(GGMLQuantizationType["Q4_K" if q4km else quant])
    q6 = int(GGMLQuantizationType.Q6_K) if q4km else base
    plan = [("token_embd.weight", (vocab, h), base)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        more = q6 if _more_bits(i, shape.layers) else base
        plan += [
            (b + "attn_norm.weight", (h,), GGML_F32),
            (b + "attn_q.weight", (h, h), base),
            (b + "attn_k.weight", (kv, h), base),
            (b + "attn_v.weight", (kv, h), more),
            (b + "attn_output.weight", (h, h), base),
            (b + "ffn_norm.weight", (h,), GGML_F32),
            (b + "ffn_gate.weight", (shape.ffn, h), base),
            (b + "ffn_up.weight", (shape.ffn, h), base),
            (b + "ffn_down.weight", (h, shape.ffn), more),
        ]
    plan += [("output_norm.weight", (h,), GGML_F32), ("output.weight", (vocab, h), q6)]
    return plan


def tensor_bytes(shape: tuple[int, ...], ggml_type: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return int(np.prod(shape)) // block * size


# ---- metadata encoding ---------------------------------------------------------
def _string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(kind: int, value: Any, item_kind: int | None = None) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        assert item_kind is not None
        head = struct.pack("<IQ", item_kind, len(value))
        if item_kind == STRING:
            return head + b"".join(_string(v) for v in value)
        return head + np.asarray(value, dtype=np.dtype(_SCALAR[item_kind])).tobytes()
    return struct.pack(_SCALAR[kind], value)


Field = tuple[str, int, Any, "int | None"]  # key, type, value, array item type


def copy_tokenizer_fields(path: str) -> list[Field]:
    """Every `tokenizer.*` metadata entry of a GGUF file, with its exact GGUF types."""
    from gguf import GGUFReader

    from strata.gguf.reader import field_value

    reader = GGUFReader(path)
    out: list[Field] = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = int(field.types[0])
        item = int(field.types[1]) if kind == ARRAY else None
        out.append((key, kind, field_value(reader, key), item))
    return out


def model_fields(shape: Shape, vocab: int, name: str, file_type: int = FILE_TYPE_BF16) -> list[Field]:
    a = "llama"
    return [
        ("general.architecture", STRING, a, None),
        ("general.name", STRING, name, None),
        ("general.file_type", U32, file_type, None),
        ("general.alignment", U32, ALIGN, None),
        (f"{a}.block_count", U32, shape.layers, None),
        (f"{a}.context_length", U32, shape.context, None),
        (f"{a}.embedding_length", U32, shape.hidden, None),
        (f"{a}.feed_forward_length", U32, shape.ffn, None),
        (f"{a}.attention.head_count", U32, shape.heads, None),
        (f"{a}.attention.head_count_kv", U32, shape.kv_heads, None),
        (f"{a}.rope.freq_base", F32, shape.rope_theta, None),
        (f"{a}.rope.dimension_count", U32, shape.head_dim, None),
        (f"{a}.attention.layer_norm_rms_epsilon", F32, 1e-5, None),
        (f"{a}.vocab_size", U32, vocab, None),
    ]


# ---- tensor data -------------------------------------------------------------------
class RandomBf16:
    """Slices of one pool of N(0, std) values as bf16 bit patterns (uint16)."""

    def __init__(self, std: float, pool: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal(pool, dtype=np.float32) * np.float32(std)).view(np.uint32)
        self.bits = ((x + 0x8000) >> 16).astype(np.uint16)  # round to nearest bf16
        self.rng = rng

    def write(self, f: BinaryIO, n: int) -> None:
        left = n
        while left:
            start = int(self.rng.integers(0, self.bits.size // 2))
            take = min(left, self.bits.size - start)
            f.write(memoryview(self.bits[start : start + take]))
            left -= take


# Where each type's fp16 scales sit in a block, the value each is set to, and the codes' bytes
# that hold signed sub-block scales (Q6_K's int8 scales, kept small): weights then stay within
# about +-0.1, like the bf16 files' N(0, 0.02).
_SCALES: dict[str, tuple[tuple[int, float], ...]] = {
    "Q4_0": ((0, 3e-3),), "Q4_1": ((0, 1.5e-3), (2, -0.01125)), "Q8_0": ((0, 3e-4),),
    "Q4_K": ((0, 1e-4), (2, 7.5e-4)), "Q5_K": ((0, 5e-5), (2, 7.5e-4)), "Q6_K": ((208, 1e-4),),
}


class RandomBlocks:
    """Slices of one pool of random blocks of a ggml type, with finite scales."""

    def __init__(self, ggml_type: int, pool_blocks: int, seed: int) -> None:
        qt = GGMLQuantizationType(ggml_type)
        _, size = GGML_QUANT_SIZES[qt]
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, (pool_blocks, size), dtype=np.uint8)
        for offset, value in _SCALES[qt.name]:
            blocks[:, offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
        if qt.name == "Q6_K":  # int8 sub-block scales in [-16, 16]
            blocks[:, 192:208] = rng.integers(-16, 17, (pool_blocks, 16)).astype(np.int8).view(np.uint8)
        self.bytes = blocks.reshape(-1)
        self.size = size
        self.rng = rng

    def write(self, f: BinaryIO, nbytes: int) -> None:
        left = nbytes
        blocks = self.bytes.size // self.size
        while left:
            start = int(self.rng.integers(0, blocks // 2)) * self.size
            take = min(left, self.bytes.size - start)
            f.write(memoryview(self.bytes[start : start + take]))
            left -= take


def _pad(f: BinaryIO) -> None:
    f.write(b"\0" * (-f.tell() % ALIGN))


def write_gguf(path: Path, shape: Shape, tokenizer: list[Field], name: str = "synthetic",
               std: float = 0.02, seed: int = 0, pool: int = 1 << 26, quant: str = "bf16") -> dict[str, Any]:
    """Write the file; returns its figures (parameters, bytes, seconds)."""
    t0 = time.perf_counter()
    tokens = next((v for k, _, v, _ in tokenizer if k == "tokenizer.ggml.tokens"), None)
    if not tokens:
        raise ValueError("the tokenizer metadata has no tokenizer.ggml.tokens")
    vocab = len(tokens)
    fields = model_fields(shape, vocab, name, FILE_TYPES[quant]) + tokenizer
    plan = tensor_plan(shape, vocab, quant)
    sizes = [tensor_bytes(s, t) for _, s, t in plan]
    random = RandomBf16(std, pool, seed)
    blocks = {t: RandomBlocks(t, pool // 64, seed + t) for _, _, t in plan if t not in (GGML_F32, GGML_BF16)}
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, len(plan), len(fields)))
        f.writelines(_string(k) + struct.pack("<I", t) + _value(t, v, i) for k, t, v, i in fields)
        offset = 0
        for (tname, tshape, ttype), size in zip(plan, sizes):
            dims = tuple(reversed(tshape))  # ggml order: the innermost dimension first
            f.write(_string(tname) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset))
            offset += size + (-size % ALIGN)
        _pad(f)
        for (_, tshape, ttype), size in zip(plan, sizes):
            n = int(np.prod(tshape))
            if ttype == GGML_BF16:
                random.write(f, n)
            elif ttype in blocks:
                blocks[ttype].write(f, size)
            else:  # norm weights: ones, as a trained model's are near
                f.write(np.ones(n, dtype=np.float32).tobytes())
            _pad(f)
    params = sum(int(np.prod(s)) for _, s, _ in plan)
    return {"path": str(path), "parameters": params, "bytes": path.stat().st_size,
            "vocab": vocab, "seconds": time.perf_counter() - t0}


def write_metadata_only(path: Path, fields: list[Field]) -> None:
    """A tensorless GGUF holding `fields`: the tokenizer, carried to a machine that lacks its source."""
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)))
        f.writelines(_string(k) + struct.pack("<I", t) + _value(t, v, i) for k, t, v, i in fields)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.synth", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokenizer-from", default=None,
                   help="GGUF whose tokenizer.* metadata is copied (default: the embedded model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", default="bf16", choices=sorted(FILE_TYPES),
                   help="the weights' type (Q4_K_M: llama.cpp's mix of Q4_K and Q6_K)")
    p.add_argument("--tokenizer-only", action="store_true",
                   help="write only the tokenizer metadata (a few MB), to use as --tokenizer-from elsewhere")
    args = p.parse_args(argv)
    src = args.tokenizer_from
    if src is None:
        from strata.default_model import default_model_path

        src = str(default_model_path())
    if args.tokenizer_only:
        write_metadata_only(args.out, copy_tokenizer_fields(src))
        print(json.dumps({"path": str(args.out), "bytes": args.out.stat().st_size}))
        return 0
    info = write_gguf(args.out, SHAPES[args.shape], copy_tokenizer_fields(src),
                      name=f"synthetic-{args.shape}", seed=args.seed, quant=args.quant)
    json.dump(info, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
