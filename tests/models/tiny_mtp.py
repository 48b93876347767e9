"""A tiny random Qwen3-Next folder with a multi-token-prediction head, and the head's reference.

transformers neither builds nor saves the head (it drops `mtp.*` on load), so
the folder is a transformers tiny model with random `mtp.*` tensors added to
its safetensors and `mtp_num_hidden_layers` to its config. The reference
computes the head from its formulas in plain torch, around transformers' own
decoder layer loaded with the head's layer weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.models.tiny_models import save_tiny

NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def save_tiny_mtp(folder: Path, kind: str = "qwen3_next", seed: int = 0, config_key: bool = True) -> None:
    """`save_tiny` plus a random MTP head: its layer shaped as the model's full-attention layer
    (each tensor drawn as `tiny_models` draws them), fc [H, 2H], three zero-centred norms."""
    model = save_tiny(kind, folder, seed)
    cfg = model.config
    full = cfg.layer_types.index("full_attention")
    weights = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(name: str, like: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(like.shape, generator=gen)
        return 1.0 + 0.2 * noise if "norm" in name else 0.15 * noise

    prefix = f"model.layers.{full}."
    for name, t in list(weights.items()):
        if name.startswith(prefix):
            weights["mtp.layers.0." + name.removeprefix(prefix)] = draw(name, t)
    h = cfg.hidden_size
    weights["mtp.fc.weight"] = 0.15 * torch.randn(h, 2 * h, generator=gen)
    for norm in NORMS:
        weights[f"mtp.{norm}.weight"] = 0.2 * torch.randn(h, generator=gen)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if config_key:
        config = json.loads((folder / "config.json").read_text())
        config["mtp_num_hidden_layers"] = 1
        (folder / "config.json").write_text(json.dumps(config))


class ReferenceMtp:
    """The head from its formulas: entry i = fc([norm_e(embed(token after i)), norm_h(hidden i)]),
    transformers' decoder layer (causal over the entries), the final norm, the model's lm_head."""

    def __init__(self, folder: Path, shadow: Path) -> None:
        """shadow: an empty folder, where a copy of the checkpoint with the head's layer in place
        of the model's full-attention layer is written (so transformers builds that layer)."""
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
        cfg = self.model.config
        self.full = cfg.layer_types.index("full_attention")
        weights = load_file(str(folder / "model.safetensors"))
        self.mtp = {k.removeprefix("mtp."): v for k, v in weights.items() if k.startswith("mtp.")}
        swapped = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        swapped.update({f"model.layers.{self.full}.{k.removeprefix('layers.0.')}": v
                        for k, v in self.mtp.items() if k.startswith("layers.0.")})
        shadow.mkdir(exist_ok=True)
        save_file(swapped, str(shadow / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(shadow)
        shadow_model = AutoModelForCausalLM.from_pretrained(shadow, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
        self.layer = shadow_model.model.layers[self.full]
        self.eps = cfg.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], eps=self.eps) * (1.0 + self.mtp[f"{name}.weight"])

    @torch.inference_mode()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """The model's final (normed) hidden states [T, H] of a prompt."""
        return self.model.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.inference_mode()
    def outputs(self, nexts: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The head's normed outputs [T, H] of entries 0..T-1: the tokens after them, the
        hidden states at them."""
        e = self._norm(self.model.model.embed_tokens(torch.tensor(nexts)), "pre_fc_norm_embedding")
        x = torch.cat((e, self._norm(hidden, "pre_fc_norm_hidden")), dim=-1) @ self.mtp["fc.weight"].T
        pos = torch.arange(len(nexts))[None]
        rope = self.model.model.rotary_emb(x[None], pos)
        mask = torch.ones(len(nexts), len(nexts), dtype=torch.bool).tril()[None, None]
        out = self.layer(x[None], position_embeddings=rope, attention_mask=mask, position_ids=pos)
        return self._norm(out[0], "norm")

    @torch.inference_mode()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(out).float()

    @torch.inference_mode()
    def drafts(self, ids: list[int], token: int, k: int) -> list[int]:
        """k greedy guesses after a prompt `ids` whose next token is `token`: the last entry's,
        then each fed back with the head's own output as the hidden state."""
        hidden = self.hidden(ids)
        nexts = ids[1:] + [token]
        out: list[int] = []
        while len(out) < k:
            heads = self.outputs(nexts, hidden)
            guess = int(self.logits(heads[-1:]).argmax())
            out.append(guess)
            nexts = nexts + [guess]
            hidden = torch.cat((hidden, heads[-1:]))
        return out
