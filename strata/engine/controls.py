"""Per-request controls on a step's logits before sampling: logit_bias, min_tokens, grammar masks.

Grammar masks arrive as llguidance's packed bits (strata/engine/masks.py
computes them). Controls never touch other rows: they write into a copy of
the logits, and a row without controls keeps its bits, so an unconstrained
lane picks the same tokens beside a constrained one as alone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from strata.engine.types import SamplingParams
from strata.errors import BadRequest


def has_controls(p: SamplingParams) -> bool:
    """Whether the request's logits need anything before sampling (then its argmax is not plain)."""
    return p.grammar is not None or bool(p.logit_bias) or p.min_tokens > 0


def controls_error(p: SamplingParams, vocab: int) -> BadRequest | None:
    """What is wrong with the request's controls, naming the field; None if nothing."""
    if not 0 <= p.min_tokens <= p.max_tokens:
        return BadRequest(f"min_tokens must be in [0, max_tokens = {p.max_tokens}], got {p.min_tokens}",
                          "min_tokens")
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in p.logit_bias):
        return BadRequest(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
    if any(not isinstance(v, (int, float)) or not -100 <= v <= 100 for v in p.logit_bias.values()):
        return BadRequest("logit_bias values must be numbers from -100 to 100", "logit_bias")
    if p.grammar is not None and not isinstance(p.grammar, str):
        return BadRequest("grammar must be llguidance grammar text", "grammar")
    return None


def banned_ids(p: SamplingParams, generated: int, eos_ids: Collection[int], vocab: int) -> list[int]:
    """Token ids that may not be picked next: the stop tokens, while fewer than min_tokens are out.

    The model's EOS ids count unless ignore_eos (then they do not end the request anyway);
    stop_token_ids outside the vocabulary can never be picked and are left out.
    """
    if generated >= p.min_tokens:
        return []
    stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_ids)
    return sorted(t for t in stops if 0 <= t < vocab)


def mask_words(vocab: int) -> int:
    """int32 words in one token bitmask of `vocab` bits."""
    return (vocab + 31) // 32


def unpack_bitmask(words: Tensor, vocab: int) -> Tensor:
    """Allowed tokens [R, vocab] (bool) from packed int32 words, bit j of word w being token 32 w + j."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).reshape(words.shape[0], -1).bool()
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    allowed = torch.zeros((words.shape[0], vocab), dtype=torch.bool, device=words.device)
    allowed[:, : bits.shape[1]] = bits
    return allowed


def biased(logits: Tensor, biases: Sequence[Mapping[int, float]],
           banned: Sequence[Sequence[int]]) -> Tensor | None:
    """A float copy of `logits` [B, V] with each row's logit_bias added and its banned ids at -inf.

    None when no row has either, so the caller samples from the logits themselves.
    """
    if not any(biases) and not any(banned):
        return None
    scores = logits.float().clone()
    device = scores.device
    rows = [r for r, b in enumerate(biases) for _ in b]
    if rows:
        ids = [t for b in biases for t in b]
        values = torch.tensor([v for b in biases for v in b.values()], dtype=scores.dtype)
        scores.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                          values.to(device), accumulate=True)
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    if rows:
        ids = [t for b in banned for t in b]
        scores[torch.tensor(rows, device=device), torch.tensor(ids, device=device)] = -torch.inf
    return scores


def masked(scores: Tensor, words: Tensor, pairs: Sequence[tuple[int, int]]) -> Tensor:
    """`scores` with -inf where masks disallow: for each (row, k), mask k of `words` covers `row`.

    A new tensor (torch.where, the fastest of the CPU's choices measured); `scores` is left as it is.
    """
    device = scores.device
    rows = [r for r, _ in pairs]
    picks = [k for _, k in pairs]
    words = words.to(device, non_blocking=True)  # the whole (pinned) block, then the rows wanted
    if picks != list(range(words.shape[0])):
        words = words[torch.tensor(picks, device=device)]
    allowed = unpack_bitmask(words, scores.shape[1])
    if rows == list(range(scores.shape[0])):
        return torch.where(allowed, scores, -torch.inf)
    index = torch.tensor(rows, device=device)
    out = scores.clone()
    out[index] = torch.where(allowed, scores[index], -torch.inf)
    return out
