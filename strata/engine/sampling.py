"""Turn one engine step's logits into tokens, for every lane that produces one.

Processing order (the one llama.cpp and vLLM use):

0. the engine's per-request controls (logit_bias, min_tokens, grammar masks;
   strata/engine/controls.py) arrive already applied, as `scores`;
1. repetition penalty, Hugging Face semantics: for every token seen in the
   prompt or the output, a positive logit is divided by the penalty and a
   negative one multiplied by it;
2. presence and frequency penalties, OpenAI semantics, counted over the
   *generated* tokens only (as vLLM does): ``logit -= frequency * count +
   presence * (count > 0)``. The prompt is the user's text; penalising it
   would make a model avoid the words it was asked about;
3. greedy rows (temperature 0): argmax, ties broken by the lowest token id;
4. sampled rows: temperature, then top_k, top_p (the smallest set of best
   tokens whose mass reaches top_p, after top_k), min_p (relative to the most
   likely token), then one draw with the row's own generator. Tokens tied
   with the last one a filter keeps are kept too (Hugging Face's rule), so
   the result never depends on token ids.

Logprobs describe the model, not the sampler: they are the log-softmax of the
raw logits, before penalties, temperature and filtering (what OpenAI reports
and vLLM's default). Token text is added by the engine (`SampledLogprob.with_text`).

Draws are an exponential race: ``argmax_i w_i / E_i`` with ``E_i ~ Exp(1)``
picks ``i`` with probability ``w_i / sum(w)``, so the weights need no
normalisation. Each row's noise comes from its own generator and always has the
full vocabulary length, and the weights ``exp(z - max z)`` involve no reduction
across rows, so a seeded request draws the same tokens whatever else is in the
batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from strata.engine.types import SamplingParams, TokenLogprob

_TINY = 1e-30  # floor for the exponential noise, so w / E never divides by zero
NUCLEUS_WINDOW = 1024  # best weights sorted for top_p before falling back to a full sort


@dataclass
class SampledLogprob:
    """One chosen token's raw logprob and its best alternatives, without text."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best first

    def with_text(self, text_of: Callable[[int], str]) -> TokenLogprob:
        """The engine's form, once it can decode token ids."""
        return TokenLogprob(
            token_id=self.token_id,
            text=text_of(self.token_id),
            logprob=self.logprob,
            top=[(t, text_of(t), lp) for t, lp in self.top],
        )


@dataclass
class SampleResult:
    tokens: Tensor  # [B] int64 on the logits' device; read it once per step (.tolist())
    logprobs: list[SampledLogprob | None]  # None where the row did not ask for logprobs


def make_generator(
    seed: int | None, fallback_seed: int, device: torch.device | str
) -> torch.Generator:
    """A request's own random stream, made once and reused for all its tokens.

    A request without a seed gets `fallback_seed` (the engine derives it from
    its base seed and a request counter), so every run can still be replayed.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed((fallback_seed if seed is None else seed) % 2**64)
    return gen


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    prompt_lens: Sequence[int] | None = None,
    scores: Tensor | None = None,
) -> SampleResult:
    """Pick one token per row of `logits` [B, V] (float32).

    `histories[i]` is row i's prompt followed by its generated ids (used only by
    penalties); `prompt_lens[i]` says where its generated part starts. Without
    `prompt_lens` the whole history counts as generated for the presence and
    frequency penalties. A sampled row whose generator is None draws from
    torch's global generator and is not reproducible. `scores`, when given, are
    the logits after the engine's controls (strata/engine/controls.py): tokens
    are picked from them, logprobs still come from the raw `logits`.
    """
    batch, vocab = logits.shape
    if not len(params) == len(histories) == len(generators) == batch:
        raise ValueError("sample: one params, history and generator per logits row")
    if prompt_lens is not None and len(prompt_lens) != batch:
        raise ValueError("sample: one prompt length per logits row")
    logits = logits.float()
    scores = logits if scores is None else scores.float()
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    pen_rows = [i for i, p in enumerate(params) if has_penalties(p)]
    drawn_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not (lp_rows or pen_rows or drawn_rows):
        return SampleResult(scores.argmax(dim=-1), [None] * batch)

    device = logits.device
    if pen_rows:
        base, scores = scores, scores.clone()
        idx = torch.tensor(pen_rows, device=device)
        scores[idx] = apply_penalties(
            base[idx],
            [params[i] for i in pen_rows],
            [histories[i] for i in pen_rows],
            None if prompt_lens is None else [prompt_lens[i] for i in pen_rows],
        )

    if not drawn_rows:
        tokens = scores.argmax(dim=-1)
    else:
        tokens = torch.empty(batch, dtype=torch.long, device=device)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=device)
            tokens[idx] = scores[idx].argmax(dim=-1)
        idx = torch.tensor(drawn_rows, device=device)
        weights = filtered_weights(scores[idx], [params[i] for i in drawn_rows])
        tokens[idx] = draw(weights, [generators[i] for i in drawn_rows])

    logprobs: list[SampledLogprob | None] = [None] * batch
    if lp_rows:
        for i, lp in zip(lp_rows, _raw_logprobs(logits, tokens, lp_rows, params)):
            logprobs[i] = lp
    return SampleResult(tokens, logprobs)


def apply_penalties(
    logits: Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    prompt_lens: Sequence[int] | None = None,
) -> Tensor:
    """Return penalised copies of `logits` [R, V] (see the module docstring).

    The histories are flattened into one index tensor, so the work is a few
    scatters however many rows and tokens there are.
    """
    rows_n, vocab = logits.shape
    device = logits.device
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.long, device=device)
    ids = list(itertools.chain.from_iterable(histories))
    flat = torch.tensor(ids, dtype=torch.long, device=device)
    row_of = torch.repeat_interleave(torch.arange(rows_n, device=device), lengths)
    out = logits.clone()

    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        penalty = torch.tensor(rep, dtype=out.dtype, device=device).unsqueeze(1)
        seen = torch.zeros(rows_n, vocab, dtype=torch.bool, device=device)
        seen[row_of, flat] = True
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)

    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    if any(pres) or any(freq):
        if prompt_lens is not None:
            starts = torch.cumsum(lengths, 0) - lengths
            pos = torch.arange(flat.numel(), device=device)
            pos = pos - torch.repeat_interleave(starts, lengths)
            first_out = torch.tensor(list(prompt_lens), dtype=torch.long, device=device)
            generated = pos >= torch.repeat_interleave(first_out, lengths)
            row_of, flat = row_of[generated], flat[generated]
        counts = torch.zeros(rows_n, vocab, dtype=out.dtype, device=device)
        counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=out.dtype), accumulate=True)
        f = torch.tensor(freq, dtype=out.dtype, device=device).unsqueeze(1)
        p = torch.tensor(pres, dtype=out.dtype, device=device).unsqueeze(1)
        out = out - counts * f - (counts > 0).to(out.dtype) * p
    return out


def filtered_weights(
    scores: Tensor, params: Sequence[SamplingParams], window: int = NUCLEUS_WINDOW
) -> Tensor:
    """Unnormalised sampling weights [R, V]: exp of the tempered scores, 0 where filtered.

    The best token keeps weight exactly 1, so every row can be drawn from. All
    three filters keep the tokens whose weight reaches a per-row floor, so
    tokens tied with the last one kept are kept too (as Hugging Face does):

    - top_k: the floor is the k-th largest weight;
    - top_p: the weight of the token at which the best-first running mass
      reaches top_p of the total (the total over the top k when top_k is set);
    - min_p: min_p itself, the best weight being 1.

    Only the best `window` weights are sorted (torch's full-vocabulary sort is
    slow on the CPU); a row whose nucleus is larger is sorted in full.
    """
    vocab = scores.shape[1]
    device = scores.device
    temp = torch.tensor([p.temperature for p in params], dtype=scores.dtype, device=device)
    z = scores / temp.unsqueeze(1)
    weights = _finite_weights(z)

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [min(max(p.top_p, 0.0), 1.0) for p in params]
    min_p = [min(max(p.min_p, 0.0), 1.0) for p in params]
    floor = torch.tensor(min_p, dtype=weights.dtype, device=device)
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        floor = torch.maximum(floor, _rank_floor(weights, top_k, top_p, window))
    elif not any(min_p):
        return weights
    return weights * (weights >= floor.unsqueeze(1))


def _finite_weights(z: Tensor) -> Tensor:
    """exp(z - max z) with no NaN or inf: +inf scores share the top weight 1, NaN scores weigh 0.

    A row with no finite best score (all NaN or -inf) keeps weight 1 on its first token,
    so every row can still be drawn from and nothing non-finite reaches `draw`.
    """
    top = torch.finfo(z.dtype).max
    z = torch.nan_to_num(z, nan=-torch.inf, posinf=top, neginf=-torch.inf)
    best = z.amax(dim=-1, keepdim=True)
    weights = (z - best).exp()
    dead = ~torch.isfinite(best.squeeze(1))
    if dead.any():
        weights[dead] = 0.0
        weights[dead, 0] = 1.0
    return weights


def _rank_floor(weights: Tensor, top_k: list[int], top_p: list[float], window: int) -> Tensor:
    """Per-row weight floor for top_k and top_p (0 for a row that uses neither)."""
    vocab = weights.shape[1]
    device = weights.device
    width = min(vocab, max([window, *(k for k in top_k if k < vocab)]))
    vals = weights.topk(width, dim=-1).values  # best first
    has_k = torch.tensor([k < vocab for k in top_k], device=device)
    last = torch.tensor([min(k, width) - 1 for k in top_k], device=device).unsqueeze(1)
    floor = torch.where(has_k, vals.gather(1, last).squeeze(1), 0.0)
    if all(p >= 1.0 for p in top_p):
        return floor

    cum = vals.cumsum(dim=-1)
    # The total mass: over the top k, or over the whole row. A sequential
    # cumsum rather than sum() keeps the bits independent of the batch.
    total = torch.where(has_k.unsqueeze(1), cum.gather(1, last), weights.cumsum(dim=-1)[:, -1:])
    limit = torch.tensor(top_p, dtype=weights.dtype, device=device).unsqueeze(1) * total
    reached = (cum < limit).sum(dim=-1, keepdim=True)  # index of the first cum >= limit
    nucleus = vals.gather(1, torch.minimum(reached, last)).squeeze(1)

    uses_p = torch.tensor([p < 1.0 for p in top_p], device=device)
    if width < vocab:
        # Rows without top_k whose nucleus did not fit in the window: sort them in full.
        spill = ((reached.squeeze(1) >= width) & uses_p & ~has_k).nonzero().squeeze(1)
        if spill.numel():
            full = weights[spill].sort(dim=-1, descending=True).values
            first = (full.cumsum(dim=-1) < limit[spill]).sum(dim=-1, keepdim=True)
            first = first.clamp_max(vocab - 1)
            nucleus[spill] = full.gather(1, first).squeeze(1)
    return torch.where(uses_p, torch.maximum(floor, nucleus), floor)


def draw(weights: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row, with probability proportional to the row's weights.

    Exp(1) noise as -log(1 - U): U < 1, so the noise is finite; a zero is
    floored so that w / E stays finite, and filtered tokens score exactly 0.
    """
    noise = torch.empty_like(weights)
    for row, gen in enumerate(generators):
        torch.rand(weights.shape[1], generator=gen, out=noise[row])
    noise.neg_().log1p_().neg_().clamp_min_(_TINY)
    return (weights / noise).argmax(dim=-1)


def _raw_logprobs(
    logits: Tensor, tokens: Tensor, rows: list[int], params: Sequence[SamplingParams]
) -> list[SampledLogprob]:
    """Chosen-token and top-k logprobs of the raw model distribution, batched over rows."""
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[idx], dim=-1)
    chosen_ids = tokens[idx]
    chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    wants = [min(max(params[i].logprobs or 0, 0), lp.shape[1]) for i in rows]
    k_max = max(wants)
    if k_max > 0:
        # a stable sort lists tied tokens lowest id first, the order greedy's argmax picks them
        top_vals, top_ids = torch.sort(lp, dim=-1, descending=True, stable=True)
        top_vals, top_ids = top_vals[:, :k_max], top_ids[:, :k_max]
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    else:
        top_vals_l = top_ids_l = [[] for _ in rows]
    return [
        SampledLogprob(tid, val, list(zip(top_ids_l[r][:k], top_vals_l[r][:k])))
        for r, (tid, val, k) in enumerate(zip(chosen_ids.tolist(), chosen.tolist(), wants))
    ]
