"""A multi-token-prediction (MTP) head: one more decoder layer that guesses the token after next.

Qwen3-Next checkpoints carry one beside the model (`mtp.*`, which transformers
drops). For the entry at position p it reads the embedding of the token at
p + 1 and the model's final hidden state at p, each through its own
RMSNorm, joins them ([embedding, hidden]), projects them back to the
hidden size (`fc`), runs one full-attention decoder layer of the model's own
kind (Qwen3-Next's gated attention and MoE) over its own past entries, and
normalises: the model's output head then gives logits for the token at
p + 2. Chained, the head's output stands in for the model's hidden state:
the entry at p + 1 reads the guessed token and the head's output at p.

The layer's K/V live in the KV pool as one more layer (index: the model's
layer count), so they move, park and roll back by length with the lane's
other cells. The engine's proposer is `engine/mtp.py`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from strata.attention.base import AttentionContext
from strata.models.base import ModelConfig
from strata.models.dense import Linear

MTP_LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")  # config.json's count


def stored_mtp_layers(config: dict[str, Any], stored: set[str]) -> int:
    """1 where a folder's config.json counts MTP layers and its weights store the first (a folder
    transformers saved has none), else 0; a head with its own embeddings is not read."""
    count = next((int(config[k]) for k in MTP_LAYER_KEYS if config.get(k)), 0)
    if count < 1 or config.get("mtp_use_dedicated_embeddings"):
        return 0
    return int("mtp.fc.weight" in stored and "mtp.layers.0.input_layernorm.weight" in stored)


class MtpHead(nn.Module):
    """The head's parameters, named as the checkpoint names them under `mtp.`: the two input
    norms, `fc` (2 x hidden -> hidden), `layers.0` (a decoder layer built by the model, whose
    attention writes pool layer `layer_index`) and the final `norm`."""

    def __init__(self, cfg: ModelConfig, layer: nn.Module, layer_index: int,
                 norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.pre_fc_norm_embedding = norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([layer])
        self.norm = norm_class(cfg.hidden_size, cfg.rms_norm_eps)

    def run(self, embedded: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            ctx: AttentionContext) -> torch.Tensor:
        """embedded [T, H] (the tokens at p + 1), hidden [T, H] (the model's, or the head's own
        output, at p) -> the head's normed output [T, H] at p, whose logits guess p + 2."""
        x = torch.cat((self.pre_fc_norm_embedding.forward(embedded), self.pre_fc_norm_hidden.forward(hidden)),
                      dim=-1)
        h = self.layers[0].forward(self.fc.forward(x), cos, sin, ctx)
        return self.norm.forward(h)
