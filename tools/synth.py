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

    python -m tools.synth OUT.gguf [--shape SHAPE] [--tokenizer-from GGUF]
        [--quant bf16|Q4_K_M|Q6_K|Q8_0|Q4_0|Q4_1|Q5_K] [--router skewed|uniform] [--seed N]
    python -m tools.synth OUT.gguf --tokenizer-only   # the tokenizer metadata alone (a few MB)

SHAPE is a dense Llama shape (llama-3.1-8b, llama-3.1-70b, llama-3.2-1b, tiny, tiny-4) or a
mixture-of-experts shape in llama.cpp's `qwen3moe` architecture (qwen3-30b-a3b; tiny-moe,
4 layers of 16 experts with 4 used, for tests).

Quantized files (`--quant`) are written the same way from a pool of random
blocks whose scale fields are set to finite values of the right size (the
codes are random bytes): `Q4_K_M` follows llama.cpp's recipe for that name
(Q4_K, with Q6_K for the output, and for attn_v and ffn_down, expert tensors
included, on the layers llama.cpp gives more bits), the others put every
matrix in that type. As in llama.cpp, a type whose blocks do not divide a
matrix's rows falls back (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0: tiny-moe's
ffn_down_exps, rows of 128), and norms and the expert router (ffn_gate_inp)
stay F32 whatever the type.

The router. Random router rows route almost uniformly, while real MoE routing
has hot and cold experts in every layer, which is what expert caching,
offloading and load balancing are measured against. So `--router skewed`
(the default; `uniform` is the control) builds each layer's ffn_gate_inp
(F32) from N(0, 1/hidden) rows, row e scaled by s_e: the expert at popularity
rank r (1 = hottest) gets s = r ** -ROUTER_SKEW (0.35), the scales normalised
to RMS 1, and a random permutation per layer (drawn from the seed and the
layer index) deals the ranks to experts, so every layer has its own hot set.
A hidden state of RMS 1 unrelated to the rows then gives expert e a logit of
about N(0, s_e^2); top-k picks the largest logits, and an expert whose logit
spreads wider lands there more often. Measured with 20000 N(0, 1) hidden rows
normalised to RMS 1 (what the router sees after an RMSNorm with weights 1),
softmax then top-k: with qwen3-30b-a3b's router (128 experts, 8 used) the top
25% of experts take about 60% of the routing in every layer, the hottest
expert about 5x the uniform rate and the coldest about 0.2x, the frequency
falling with rank like rank ** -0.6 over the hotter half; `uniform` gives
about 27% (25% is exact balance). No router makes consecutive tokens pick
the same experts: that correlation belongs to the hidden states, and random
hidden states have none. The construction has a ceiling when many experts
are used: a router without bias turns -x into opposite logits, so for hidden
states symmetric about zero an expert is in the top k at most half the time;
with 4 of 16 experts used (tiny-moe) the top 25% can take at most 50%, and
it measures about 32%.
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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, Keys

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
    """A decoder's dimensions: untied output, SwiGLU, grouped-query attention.

    Dense shapes are Llama's (head_dim = hidden / heads). With `experts` set the shape is
    llama.cpp's qwen3moe: every layer's FFN is a routed mixture of `experts` SwiGLU experts of
    width `expert_ffn`, `experts_used` of them per token, attention has per-head q/k RMSNorms,
    and head_dim is its own number (`head_size`); `ffn` is then only the metadata's dense size.
    """

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    context: int = 131072
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    head_size: int = 0  # 0: hidden // heads
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def arch(self) -> str:
        return "qwen3moe" if self.moe else "llama"


SHAPES = {
    "llama-3.1-8b": Shape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8),
    "llama-3.2-1b": Shape(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8),
    "llama-3.1-70b": Shape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8),
    "tiny": Shape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, context=4096),
    "tiny-4": Shape(layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, context=4096),  # room to split
    "qwen3-30b-a3b": Shape(layers=48, hidden=2048, ffn=6144, heads=32, kv_heads=4, context=40960,
                           rope_theta=1e6, rms_eps=1e-6, head_size=128,
                           experts=128, experts_used=8, expert_ffn=768),
    "tiny-moe": Shape(layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, context=4096,
                      rope_theta=1e6, rms_eps=1e-6, head_size=64,
                      experts=16, experts_used=4, expert_ffn=128),
}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K for attn_v and ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _ggml(name: str) -> int:
    return int(GGMLQuantizationType[name])


def _q4_k_m_type(kind: str, layer: int, shape: Shape) -> str:
    """llama.cpp's Q4_K_M choice for a matrix (`kind`: its name without blk.N. and .weight).

    Expert tensors follow their dense kind (ffn_down_exps is an ffn_down); a model of exactly
    8 experts (Mixtral's count) gets llama.cpp's extra bits for attn_k, attn_v and attn_output.
    """
    kind = kind.removesuffix("_exps")
    if kind == "output":
        return "Q6_K"
    if shape.experts == 8 and kind in ("attn_k", "attn_v"):
        return "Q8_0"
    if shape.experts == 8 and kind == "attn_output":
        return "Q5_K"
    if kind in ("attn_v", "ffn_down") and _more_bits(layer, shape.layers):
        return "Q6_K"
    return "Q4_K"


# llama.cpp's tensor_type_fallback for a type whose blocks do not divide a matrix's rows
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _fitting(type_name: str, row: int) -> int:
    """The ggml type `type_name`, or llama.cpp's fallback when its blocks do not divide `row`."""
    for name in (type_name, _FALLBACK.get(type_name)):
        if name is not None and row % GGML_QUANT_SIZES[GGMLQuantizationType[name]][0] == 0:
            return _ggml(name)
    raise ValueError(f"rows of {row} values fit neither {type_name} nor its fallback")


def _matrix_type(kind: str, layer: int, dims: tuple[int, ...], shape: Shape, quant: str) -> int:
    """The ggml type of a weight matrix (2-D, or 3-D for experts) under `quant`."""
    if quant == "bf16":
        return GGML_BF16
    name = _q4_k_m_type(kind, layer, shape) if quant == "Q4_K_M" else quant
    return _fitting(name, dims[-1])


Plan = list[tuple[str, tuple[int, ...], int]]


def _attention(shape: Shape, layer: int, quant: str) -> Plan:
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    b = f"blk.{layer}."
    mats = [("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, q))]
    plan = [(b + "attn_norm.weight", (h,), GGML_F32)]
    plan += [(f"{b}{k}.weight", d, _matrix_type(k, layer, d, shape, quant)) for k, d in mats]
    if shape.moe:
        plan += [(b + "attn_q_norm.weight", (shape.head_dim,), GGML_F32),
                 (b + "attn_k_norm.weight", (shape.head_dim,), GGML_F32)]
    return plan


def _ffn(shape: Shape, layer: int, quant: str) -> Plan:
    h, b = shape.hidden, f"blk.{layer}."
    if shape.moe:
        e, f = shape.experts, shape.expert_ffn
        mats = [("ffn_gate_exps", (e, f, h)), ("ffn_up_exps", (e, f, h)),
                ("ffn_down_exps", (e, h, f))]
        head = [(b + "ffn_norm.weight", (h,), GGML_F32),
                (b + "ffn_gate_inp.weight", (e, h), GGML_F32)]
    else:
        f = shape.ffn
        mats = [("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))]
        head = [(b + "ffn_norm.weight", (h,), GGML_F32)]
    return head + [(f"{b}{k}.weight", d, _matrix_type(k, layer, d, shape, quant)) for k, d in mats]


def tensor_plan(shape: Shape, vocab: int, quant: str = "bf16") -> Plan:
    """(name, torch-order shape, ggml type) of every tensor, in file order."""
    h = shape.hidden
    embd = _matrix_type("token_embd", -1, (vocab, h), shape, quant)
    plan = [("token_embd.weight", (vocab, h), embd)]
    for i in range(shape.layers):
        plan += _attention(shape, i, quant) + _ffn(shape, i, quant)
    out = _matrix_type("output", -1, (vocab, h), shape, quant)
    return plan + [("output_norm.weight", (h,), GGML_F32), ("output.weight", (vocab, h), out)]


# ---- the expert router -----------------------------------------------------------
ROUTER_SKEW = 0.35  # the expert at popularity rank r gets router row scale r ** -ROUTER_SKEW
ROUTERS = ("skewed", "uniform")
_PERMUTATION, _ROWS = 0, 1  # the two random streams of a layer's router


def _layer_rng(seed: int, layer: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, layer, stream])


def router_scales(experts: int, layer: int, seed: int = 0, router: str = "skewed") -> np.ndarray:
    """Each expert's router row scale in one layer (float64 [experts], RMS 1).

    `skewed`: rank r's scale is r ** -ROUTER_SKEW, ranks dealt to experts by a random
    permutation of this layer's own; `uniform`: all ones. argsort(-scales) is the layer's
    experts from hottest to coldest.
    """
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, not {router!r}")
    if router == "uniform":
        return np.ones(experts)
    by_rank = np.arange(1, experts + 1, dtype=np.float64) ** -ROUTER_SKEW
    by_rank /= np.sqrt(np.mean(by_rank**2))
    scales = np.empty(experts)
    scales[_layer_rng(seed, layer, _PERMUTATION).permutation(experts)] = by_rank
    return scales


def router_weights(shape: Shape, layer: int, seed: int = 0, router: str = "skewed") -> np.ndarray:
    """Layer `layer`'s ffn_gate_inp, as the file holds it: float32 [experts, hidden], torch order.

    Row e is N(0, 1/hidden) times router_scales' s_e, so a hidden state of RMS 1 gives expert e
    a logit of spread about s_e (see the module docstring for the routing this yields).
    """
    if not shape.moe:
        raise ValueError("a dense shape has no router")
    scales = router_scales(shape.experts, layer, seed, router)
    rows = _layer_rng(seed, layer, _ROWS).standard_normal((shape.experts, shape.hidden))
    rows /= np.sqrt(shape.hidden)
    return (rows * scales[:, None]).astype(np.float32)


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
    a = shape.arch
    L, A = Keys.LLM, Keys.Attention

    def u32(key: str, value: int) -> Field:
        return (key.format(arch=a), U32, value, None)

    fields: list[Field] = [
        ("general.architecture", STRING, a, None),
        ("general.name", STRING, name, None),
        ("general.file_type", U32, file_type, None),
        ("general.alignment", U32, ALIGN, None),
        u32(L.BLOCK_COUNT, shape.layers),
        u32(L.CONTEXT_LENGTH, shape.context),
        u32(L.EMBEDDING_LENGTH, shape.hidden),
        u32(L.FEED_FORWARD_LENGTH, shape.ffn),
        u32(A.HEAD_COUNT, shape.heads),
        u32(A.HEAD_COUNT_KV, shape.kv_heads),
        (Keys.Rope.FREQ_BASE.format(arch=a), F32, shape.rope_theta, None),
    ]
    if shape.moe:
        fields += [u32(L.EXPERT_FEED_FORWARD_LENGTH, shape.expert_ffn),
                   u32(L.EXPERT_COUNT, shape.experts), u32(L.EXPERT_USED_COUNT, shape.experts_used),
                   u32(A.KEY_LENGTH, shape.head_dim), u32(A.VALUE_LENGTH, shape.head_dim)]
    else:
        fields.append(u32(Keys.Rope.DIMENSION_COUNT, shape.head_dim))
    return fields + [(A.LAYERNORM_RMS_EPS.format(arch=a), F32, shape.rms_eps, None),
                     u32(L.VOCAB_SIZE, vocab)]


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
    "Q5_0": ((0, 1.5e-3),), "Q5_1": ((0, 1.5e-3), (2, -0.02325)),  # the fallbacks
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


def _layer(name: str) -> int:
    """N of a blk.N.* tensor name."""
    return int(name.split(".")[1])


def write_gguf(path: Path, shape: Shape, tokenizer: list[Field], name: str = "synthetic",
               std: float = 0.02, seed: int = 0, pool: int = 1 << 26, quant: str = "bf16",
               router: str = "skewed") -> dict[str, Any]:
    """Write the file; returns its figures (parameters, bytes, seconds).

    `router` (skewed or uniform, see router_weights) matters only for a mixture-of-experts shape.
    """
    t0 = time.perf_counter()
    tokens = next((v for k, _, v, _ in tokenizer if k == "tokenizer.ggml.tokens"), None)
    if not tokens:
        raise ValueError("the tokenizer metadata has no tokenizer.ggml.tokens")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, not {router!r}")
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
        for (tname, tshape, ttype), size in zip(plan, sizes):
            n = int(np.prod(tshape))
            if ttype == GGML_BF16:
                random.write(f, n)
            elif ttype in blocks:
                blocks[ttype].write(f, size)
            elif tname.endswith(".ffn_gate_inp.weight"):
                f.write(router_weights(shape, _layer(tname), seed, router).tobytes())
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
    p.add_argument("--router", default="skewed", choices=ROUTERS,
                   help="mixture-of-experts shapes: hot experts in every layer (skewed) "
                        "or plain random rows (uniform)")
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
                      name=f"synthetic-{args.shape}", seed=args.seed, quant=args.quant,
                      router=args.router)
    json.dump(info, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
