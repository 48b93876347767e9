"""A test-only AttentionContext: one sequence, all K/V kept in per-layer lists.

It stands in for the pool-based context so model code can be checked against
transformers without the KV pool. Attention is plain causal SDPA (within the window of a
sliding layer) with the KV heads repeated for grouped-query attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.models.base import ModelConfig


class DenseContext:
    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.k: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]

    def cached(self, layer: int) -> int:
        return sum(t.shape[0] for t in self.k[layer])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        start = self.cached(layer)
        self.k[layer].append(k)
        self.v[layer].append(v)
        keys = torch.cat(self.k[layer])
        values = torch.cat(self.v[layer])
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        t, s = q.shape[0], keys.shape[0]
        dev = q.device
        key_pos = torch.arange(s, device=dev)[None, :]
        q_pos = (start + torch.arange(t, device=dev))[:, None]
        mask = key_pos <= q_pos
        if window is not None:  # a sliding layer: the last `window` keys, itself included
            mask &= key_pos > q_pos - window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=self.cfg.attn_scale,
        )
        return out.transpose(0, 1)


@torch.inference_mode()
def prompt_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] for every position of one prompt."""
    ctx = DenseContext(loaded.config)
    dev = loaded.device
    ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
    hidden = loaded.model(ids_t, torch.arange(len(ids), device=dev), ctx)
    return loaded.model.compute_logits(hidden)


@torch.inference_mode()
def greedy(loaded, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after a prompt: one prefill, then one token per step."""
    model, dev = loaded.model, loaded.device
    ctx = DenseContext(loaded.config)
    hidden = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), ctx)
    out = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    pos = len(ids)
    while len(out) < n:
        hidden = model(torch.tensor([out[-1]], device=dev), torch.tensor([pos], device=dev), ctx)
        out.append(int(model.compute_logits(hidden).argmax(-1)))
        pos += 1
    return out
