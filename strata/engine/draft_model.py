"""Drafts from a small model with the same tokenizer (`--spec-model FILE`), run greedily on its own pool.

The draft model keeps, per main lane, a lane of its own small pool and the
tokens whose K/V that lane holds. Before drafting for a request it cuts its
lane back to the longest prefix shared with the request's context (a
rejected draft, a new turn, an edit: rolled back by length, as the main
pool), reads what is new, then decodes greedily one token at a time until
it has k tokens or its probability for the next one falls below
`--spec-min-p`. A greedy draft is a point mass, so the main engine's
verification keeps the output distribution (speculative.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from strata.engine.runner import Runner
from strata.engine.scheduler import common_prefix
from strata.errors import ModelLoadError
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec
from strata.models.moe import graph_safe

if TYPE_CHECKING:
    from strata.engine.request import Request
    from strata.engine.speculative import LaneDrafting
    from strata.models.loader import LoadedModel
    from strata.tokenizer import Tokenizer

READ_CHUNK = 512  # context tokens the draft model reads per forward
_KV = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_same_vocabulary(draft: Tokenizer, main: Tokenizer, path: str) -> None:
    """A draft model must spell every token id as the main model does, or its drafts mean nothing."""
    if draft.vocab_size != main.vocab_size:
        raise ModelLoadError(path, f"--spec-model has {draft.vocab_size} tokens, the model {main.vocab_size}: "
                                   "a draft model needs the same tokenizer")
    differ = next((i for i in range(main.vocab_size) if draft.token_bytes(i) != main.token_bytes(i)), None)
    if differ is not None:
        raise ModelLoadError(path, f"--spec-model spells token {differ} as {draft.token_bytes(differ)!r}, "
                                   f"the model as {main.token_bytes(differ)!r}: a draft model needs the "
                                   "same tokenizer")


class DraftModelProposer:
    """Greedy drafts of `loaded`'s model, one lane of its pool per main lane."""

    name = "draft_model"

    def __init__(self, loaded: LoadedModel, lanes: int, max_context: int, min_p: float) -> None:
        model = loaded.model
        if model.state_layers():
            raise ModelLoadError(loaded.path, "--spec-model: a draft model with recurrent or sliding-window "
                                              "layers cannot be rolled back past rejected drafts yet")
        cfg = loaded.config
        param = next(model.parameters())
        self.device = param.device
        fmt = make_format(_KV[param.dtype], cfg.num_kv_heads, cfg.head_dim)
        if model.max_positions < max_context:
            model.set_max_positions(max_context)
        self.pool = KvPool(fmt, model.pool_layers(), lanes, max_context, min(4096, max_context), None, self.device)
        self.runner = Runner(model, self.pool, cfg.attn_scale, self.device, graphs=graph_safe(model))
        self.max_context = max_context
        self.min_p = min_p
        self.bytes = self.pool.total_bytes()
        self._fed: list[list[int]] = [[] for _ in range(lanes)]  # tokens each draft lane holds
        self._lane_of: dict[int, int] = {}  # request id -> its draft lane

    def _lane(self, req: Request, ctx: list[int]) -> int:
        lane = self._lane_of.get(req.id)
        if lane is None:  # the free lane sharing the most with the context: a later turn reuses it
            taken = set(self._lane_of.values())
            free = [i for i in range(len(self._fed)) if i not in taken]
            lane = max(free, key=lambda i: common_prefix(self._fed[i], ctx))
            self._lane_of[req.id] = lane
        return lane

    @torch.inference_mode()
    def propose(self, req: Request, state: LaneDrafting, k: int) -> list[int]:
        ctx = req.prompt + req.output  # the last output token is the main lane's pending one
        k = min(k, self.max_context - len(ctx))
        if k <= 0:
            return []
        lane = self._lane(req, ctx)
        fed = self._fed[lane]
        pos = min(common_prefix(fed, ctx), len(ctx) - 1)  # the last token is read again for its logits
        del fed[pos:]
        self.pool.reserve(lane, len(ctx) + k)
        logits = None
        while pos < len(ctx):
            n = min(READ_CHUNK, len(ctx) - pos)
            last = pos + n == len(ctx)
            seq = SeqSpec(lane, pos, n, prompt=n > 1)  # a long catch-up as prompt rows; drafts need no exact bits
            logits = self.runner.forward([seq], ctx[pos : pos + n], [int(last)])
            fed += ctx[pos : pos + n]
            pos += n
        drafts: list[int] = []
        while logits is not None:
            p, t = logits[0].float().softmax(-1).max(-1)
            if float(p) < self.min_p:
                break
            drafts.append(int(t))
            if len(drafts) == k:
                break
            logits = self.runner.forward([SeqSpec(lane, pos, 1)], [drafts[-1]], [1])
            fed.append(drafts[-1])
            pos += 1
        return drafts

    def finished(self, req: Request, state: LaneDrafting) -> None:
        self._lane_of.pop(req.id, None)  # its lane keeps what it read, for the conversation's next turn

