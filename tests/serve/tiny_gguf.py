"""A tiny random llama GGUF that speaks with the default model's tokenizer and chat template.

Two layers of width 64 load and decode in a blink, while the real tokenizer
and template keep requests realistic. Written with numpy and the `gguf`
package only (no transformers), in about a second.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from strata.gguf import GGUFFile
from tests.gguf_writer import add_fields, finish

HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 2, 4, 2


def write_tiny_gguf(default_gguf: Path, path: Path, seed: int = 0, hidden: int = HIDDEN,
                    extra: Callable[[GGUFWriter], None] | None = None) -> Path:
    """`hidden` other than the default gives another model (another identity, other K/V shapes);
    `extra` adds metadata of its own (e.g. `w.add_sampling_temp(0.6)`)."""
    source = GGUFFile(str(default_gguf)).metadata
    vocab = int(source["llama.vocab_size"])
    head_dim = hidden // HEADS
    ffn = 2 * hidden
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, size=(rows, cols)).astype(np.float32)

    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(LAYERS)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    add_fields(w, {k: v for k, v in source.items() if k.startswith("tokenizer.")})
    if extra is not None:
        extra(w)
    w.add_tensor("token_embd.weight", weight(vocab, hidden).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", weight(HEADS * head_dim, hidden))
        w.add_tensor(p + "attn_k.weight", weight(KV_HEADS * head_dim, hidden))
        w.add_tensor(p + "attn_v.weight", weight(KV_HEADS * head_dim, hidden))
        w.add_tensor(p + "attn_output.weight", weight(hidden, HEADS * head_dim))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", weight(ffn, hidden))
        w.add_tensor(p + "ffn_up.weight", weight(ffn, hidden))
        w.add_tensor(p + "ffn_down.weight", weight(hidden, ffn))
    finish(w)
    return path
