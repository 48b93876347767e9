"""A tiny random llama GGUF that speaks with the default model's tokenizer and chat template.

Two layers of width 64 load and decode in a blink, while the real tokenizer
and template keep requests realistic. Written with numpy and the `gguf`
package only (no transformers), in about a second.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from strata.gguf import GGUFFile

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def _copy_tokenizer(w: GGUFWriter, metadata: dict) -> None:
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)


def write_tiny_gguf(default_gguf: Path, path: Path, seed: int = 0) -> Path:
    source = GGUFFile(str(default_gguf)).metadata
    vocab = int(source["llama.vocab_size"])
    head_dim = HIDDEN // HEADS
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, size=(rows, cols)).astype(np.float32)

    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(LAYERS)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    _copy_tokenizer(w, source)
    w.add_tensor("token_embd.weight", weight(vocab, HIDDEN).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", weight(HEADS * head_dim, HIDDEN))
        w.add_tensor(p + "attn_k.weight", weight(KV_HEADS * head_dim, HIDDEN))
        w.add_tensor(p + "attn_v.weight", weight(KV_HEADS * head_dim, HIDDEN))
        w.add_tensor(p + "attn_output.weight", weight(HIDDEN, HEADS * head_dim))
        w.add_tensor(p + "ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", weight(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", weight(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", weight(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
