"""Gated DeltaNet: the linear-attention layers of Qwen3-Next, and the math they run.

Each head keeps a matrix state S [Dk, Dv] instead of K/V cells. Per token
the state decays by exp(g), the value it predicts for the token's key is
corrected towards the token's value with strength beta (the delta rule),
and the output reads the state with the query:

    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q

The recurrent form runs that loop token by token (a decode step: one
token per sequence, many sequences at once). The chunked form computes
the same thing for a prompt in blocks of 64 tokens: inside a block the
corrections are one triangular solve (the WY form), between blocks only
the state travels, so a long prompt costs matrix products instead of a
Python loop per token. Both keep the state in float32.

Ahead of the delta rule sits a causal depthwise convolution of kernel K
over q, k and v; its state is the last K-1 inputs, so a sequence read in
pieces convolves exactly as if read at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from strata.kv.state import PadRows, RunStates, StateContext, StateShapes
from strata.models import ops
from strata.models.base import ModelConfig
from strata.models.deltanet_fla import (
    VarlenLayout,
    backend_for,
    fla_conv,
    fla_delta_rule,
    fla_kernels,
    varlen_layout,
)
from strata.models.dense import Linear
from strata.uploads import upload

CHUNK = 64


def cut_parts(span: tuple[int, int], cuts: tuple[int, ...]) -> list[tuple[int, int]]:
    """A span (first row, rows) split after each of its cut rows (0 < c < rows, ascending)."""
    start, n = span
    bounds = [0, *cuts, n]
    return [(start + lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]


def step_parts(states: StateContext) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Every sequence's span of the step split at its cuts (`cut_rounds`' key)."""
    return tuple(tuple(cut_parts(span, cuts)) for span, cuts in zip(states.spans, states.cuts))


@dataclass(frozen=True)
class CutRound:
    """Round r of `GatedDeltaNet.mix_cut`: part r of each sequence that has one.

    `rows` [P] / `seqs` [S]: the step's rows and sequences it takes (device); `spans`: its
    parts as spans of those rows; `cut_at`: (sequence, rows done at the part's end, or 0 where
    the part ends the sequence's span and so is no cut); `rows_block` / `seqs_block`: the same
    as a slice where they are consecutive (a view instead of a gather and a scatter: a later
    turn's one lane), else None."""

    rows: torch.Tensor
    seqs: torch.Tensor
    spans: list[tuple[int, int]]
    cut_at: list[tuple[int, int]]
    rows_block: slice | None = None
    seqs_block: slice | None = None

    def row_index(self) -> torch.Tensor | slice:
        return self.rows if self.rows_block is None else self.rows_block

    def seq_index(self) -> torch.Tensor | slice:
        return self.seqs if self.seqs_block is None else self.seqs_block


def _block(values: list[int]) -> slice | None:
    """values as a slice where they are consecutive and ascending, else None."""
    if values and values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return None


@functools.lru_cache(maxsize=8)
def cut_rounds(parts: tuple[tuple[tuple[int, int], ...], ...], device: torch.device) -> list[CutRound]:
    """The rounds of a step's parts (cached: every DeltaNet layer of the step asks for the same,
    and its index tensors go to the device once)."""
    rounds = []
    for r in range(max(len(p) for p in parts)):
        seqs = [i for i, p in enumerate(parts) if len(p) > r]
        spans: list[tuple[int, int]] = []
        rows: list[int] = []
        for i in seqs:
            start, n = parts[i][r]
            spans.append((len(rows), n))
            rows.extend(range(start, start + n))
        cut_at = [(i, sum(n for _, n in parts[i][: r + 1]) if r < len(parts[i]) - 1 else 0) for i in seqs]
        rounds.append(CutRound(upload(rows, device), upload(seqs, device), spans, cut_at, _block(rows), _block(seqs)))
    return rounds


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dimension (eps inside the root, as the reference kernels have it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution with SiLU, continuing from the inputs before x.

    x [B, T, C]; weight [C, K]; tail [B, C, K-1]: the K-1 inputs before x (zeros at the start).
    Returns (silu(conv) [B, T, C] in x's dtype, the new tail [B, C, K-1] in float32).
    """
    b, t, c = x.shape
    k = weight.shape[-1]
    full = torch.cat((tail.to(x.dtype), x.transpose(1, 2)), dim=-1)  # [B, C, K-1+T]
    out = F.conv1d(full, weight.unsqueeze(1).to(x.dtype), groups=c)  # [B, C, T]
    return F.silu(out).transpose(1, 2), full[..., full.shape[-1] - (k - 1):].float()


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Heads first in float32, k heads repeated to the v heads, q and k unit length, q scaled."""
    hv = v.shape[2]
    rep = hv // k.shape[2]
    if rep > 1:  # v head j reads k head j // rep
        q = q.repeat_interleave(rep, dim=2)
        k = k.repeat_interleave(rep, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))  # [B, H, T, D]
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))  # [B, H, T]
    if state is None:
        state = torch.zeros(v.shape[0], hv, k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
    return q, k, v, g, beta, state.float()


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token (decode).

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g (log decay, <= 0), beta [B, T, Hv];
    state [B, Hv, Dk, Dv] or None (zeros). Returns (out [B, T, Hv, Dv] in v's dtype, final
    state [B, Hv, Dk, Dv] float32).
    """
    dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state)
    outs = []
    for i in range(v.shape[2]):
        s = s * g[:, :, i, None, None].exp()
        predicted = torch.einsum("bhkv,bhk->bhv", s, k[:, :, i])
        delta = (v[:, :, i] - predicted) * beta[:, :, i, None]
        s = s + k[:, :, i, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, i]))
    return torch.stack(outs, dim=1).to(dtype), s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor | None = None, chunk: int = CHUNK
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule in blocks of `chunk` tokens (prompt reading); arguments and results as
    `recurrent_gated_delta_rule`.

    Inside a block, with G the cumulative log decay from the block's start and S0 the state
    before it, the corrections u solve (I + A) u = beta v - beta exp(G) k S0 with
    A[i, j] = beta_i exp(G_i - G_j) k_i.k_j for j < i; then
    out_i = exp(G_i) q_i S0 + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j and the block leaves
    S = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T.
    """
    dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state)
    b, h, t, dv = v.shape
    pad = -t % chunk  # padded tokens: k = 0 and g = 0 leave the state alone
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, chunk) for x in (g, beta))
    cum = g.cumsum(dim=-1)  # [B, H, N, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2)) * decay  # the diagonal is ignored: the solve is unit-triangular
    u_v = torch.linalg.solve_triangular(a, v * beta[..., None], upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(a, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    block_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    out = torch.empty_like(v)
    for i in range(n):
        u = u_v[:, :, i] - u_s[:, :, i] @ s
        out[:, :, i] = q_decayed[:, :, i] @ s + inner[:, :, i] @ u
        s = s * block_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = out.reshape(b, h, n * chunk, dv)[:, :, :t]
    return out.transpose(1, 2).to(dtype), s


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times silu(z): the DeltaNet's output gate."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """A Qwen3-Next linear-attention layer: projections, short convolution, delta rule, gated norm.

    Parameter names and layouts are Hugging Face's: in_proj_qkvz holds, per key head, its q and
    k rows and then the v and z rows of the value heads that read it; in_proj_ba likewise b and a.
    """

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkvz = Linear(cfg.hidden_size, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = Linear(cfg.hidden_size, 2 * self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(value_dim, cfg.hidden_size, bias=False)

    def state_shapes(self) -> StateShapes:
        """The convolution's tail (its last K-1 inputs) and the delta rule's matrix per head."""
        return {"conv": (self.conv_dim, self.kernel - 1), "ssm": (self.hv, self.dk, self.dv)}

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> mixed q|k|v [T, conv_dim], z [T, Hv, Dv], b and a [T, Hv]."""
        t = x.shape[0]
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz.forward(x).view(t, self.hk, -1)
        q, k, v, z = qkvz.split((self.dk, self.dk, r * self.dv, r * self.dv), dim=-1)
        ba = self.in_proj_ba.forward(x).view(t, self.hk, 2 * r)
        b, a = ba.split((r, r), dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta (the delta rule's strength) and g (the log decay, float32) from b and a."""
        return ops.deltanet_gates(b, a, self.A_log, self.dt_bias)

    def _mix(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
             ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """B sequences of T rows each (mixed [B, T, conv_dim], b and a [B, T, Hv]) from their
        states -> (core output [B, T, Hv, Dv], new conv tail, new matrix state)."""
        bsz, t, _ = mixed.shape
        mixed, conv = causal_conv1d(mixed, self.conv1d.weight.squeeze(1), conv)
        key_dim = self.hk * self.dk
        q, k, v = mixed.split((key_dim, key_dim, self.hv * self.dv), dim=-1)
        q = q.reshape(bsz, t, self.hk, self.dk)
        k = k.reshape(bsz, t, self.hk, self.dk)
        v = v.reshape(bsz, t, self.hv, self.dv)
        beta, g = self._gates(b, a)
        rule = recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule
        out, ssm = rule(q, k, v, g, beta, ssm)
        return out, conv, ssm

    def mix_spans_torch(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
                        ssm: torch.Tensor, spans: list[tuple[int, int]]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's rows (mixed [T, conv_dim], b and a [T, Hv]), sequence i's rows at spans[i],
        from their states (conv [S, conv_dim, K-1], ssm [S, Hv, Dk, Dv]) -> (core output
        [T, Hv, Dv], new conv tails, new matrix states): the torch reference.

        The one-row spans (decode) are computed together; each longer span (a prompt or a part
        of one) by itself in the chunked form. A step of one-row spans only makes no index
        tensors from host lists, so a CUDA graph can capture it (engine/graphs.py).
        """
        if all(span == (i, 1) for i, span in enumerate(spans)):  # a decode step: no index tensors
            o, conv, ssm = self._mix(mixed[:, None], b[:, None], a[:, None], conv, ssm)
            return o[:, 0], conv, ssm
        conv, ssm = conv.clone(), ssm.clone()
        out = torch.empty(mixed.shape[0], self.hv, self.dv, dtype=mixed.dtype, device=mixed.device)
        single = [i for i, (_, n) in enumerate(spans) if n == 1]
        if single:
            seqs = upload(single, mixed.device)
            rows = upload([spans[i][0] for i in single], mixed.device)
            o, conv[seqs], ssm[seqs] = self._mix(mixed[rows, None], b[rows, None], a[rows, None],
                                                 conv[seqs], ssm[seqs])
            out[rows] = o[:, 0]
        for i, (start, n) in enumerate(spans):
            if n > 1:
                part = slice(start, start + n)
                o, conv[i : i + 1], ssm[i : i + 1] = self._mix(mixed[None, part], b[None, part],
                                                               a[None, part], conv[i : i + 1], ssm[i : i + 1])
                out[part] = o[0]
        return out, conv, ssm

    def mix_runs(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
                 ssm: torch.Tensor, spans: list[tuple[int, int]], runs: list[bool]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, RunStates]]:
        """`mix_spans_torch` for a step with verified runs of drafts (`runs[i]`): each run's rows
        are computed one at a time, the arithmetic of decoding them one a step, and its state
        after every row comes back (run index -> its states, row by row) so the rows verification
        rejects can be undone (`StatePool.rewind`)."""
        plain = [(start, 0) if run else (start, n) for (start, n), run in zip(spans, runs)]
        out, conv, ssm = self.mix_spans_torch(mixed, b, a, conv, ssm, plain)  # 0 rows: untouched
        after: dict[int, RunStates] = {}
        for i, ((start, n), run) in enumerate(zip(spans, runs)):
            if not run:
                continue
            c, s = conv[i : i + 1], ssm[i : i + 1]
            convs, ssms = [], []
            for r in range(start, start + n):
                o, c, s = self._mix(mixed[r : r + 1, None], b[r : r + 1, None], a[r : r + 1, None], c, s)
                out[r] = o[0, 0]
                convs.append(c[0])
                ssms.append(s[0])
            conv[i], ssm[i] = c[0], s[0]
            after[i] = RunStates({"conv": convs, "ssm": ssms})
        return out, conv, ssm, after

    def mix_cut(self, mix: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
                ssm: torch.Tensor, states: StateContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`mix` (one of the `mix_spans_*`) over the step's spans split at their cut points
        (`states.cuts`): round r computes part r of every sequence that has one, from the state
        the part before left, and each state at a cut goes to `states.keep_cut`. The parts are the
        spans that steps ending at the cuts would have had."""
        out = torch.empty(mixed.shape[0], self.hv, self.dv, dtype=mixed.dtype, device=mixed.device)
        conv, ssm = conv.clone(), ssm.clone()
        for r in cut_rounds(step_parts(states), mixed.device):
            o, c, s = mix(mixed[r.rows], b[r.rows], a[r.rows], conv[r.seqs], ssm[r.seqs], r.spans)
            out[r.rows] = o
            conv[r.seqs], ssm[r.seqs] = c, s
            for j, (i, done) in enumerate(r.cut_at):
                if done:
                    states.keep_cut(self.layer_index, i, done, {"conv": c[j], "ssm": s[j]})
        return out, conv, ssm

    def mix_cut_fla(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
                    ssm: torch.Tensor, states: StateContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`mix_cut` through FLA's kernels: the convolution once over the whole spans (a row's
        output depends only on the K-1 inputs before it, wherever the parts end), each
        convolution tail at a cut taken from the inputs, and the delta rule in rounds. On the
        GPU a convolution call costs about 0.5 ms of host time, so this saves one per cut
        round and layer."""
        kernels = fla_kernels()
        if kernels is None:
            raise RuntimeError("flash-linear-attention (the package fla-core) does not import")
        spans = states.spans
        x, conv_after = fla_conv(kernels, mixed, self.conv1d.weight.squeeze(1), conv,
                                 varlen_layout(tuple(spans), mixed.device))
        t, key_dim, back = x.shape[0], self.hk * self.dk, self.kernel - 1
        q, k, v = x.split((key_dim, key_dim, self.hv * self.dv), dim=-1)
        q, k, v = q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk), v.view(t, self.hv, self.dv)
        beta, g = self._gates(b, a)
        out = torch.empty(t, self.hv, self.dv, dtype=x.dtype, device=x.device)
        ssm = ssm.clone()
        for r in cut_rounds(step_parts(states), mixed.device):
            rows, seqs = r.row_index(), r.seq_index()
            o, after = fla_delta_rule(kernels, q[rows], k[rows], v[rows], g[rows], beta[rows], ssm[seqs],
                                      varlen_layout(tuple(r.spans), mixed.device))
            out[rows] = o
            ssm[seqs] = after
            for j, (i, done) in enumerate(r.cut_at):
                if done:  # the K-1 inputs before the cut: the older tail's end, then the span's rows
                    start, lo = spans[i][0], max(0, done - back)
                    tail = torch.cat((conv[i][:, done - lo:], mixed[start + lo : start + done].T.float()), dim=1)
                    states.keep_cut(self.layer_index, i, done, {"conv": tail, "ssm": after[j]})
        return out, conv_after, ssm

    def mix_spans_fla(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
                      ssm: torch.Tensor, spans: list[tuple[int, int]], layout: VarlenLayout | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`mix_spans_torch` through flash-linear-attention's kernels (CUDA, `deltanet_fla.py`):
        one convolution launch for every span, one delta-rule launch for the decode rows and
        one for the longer spans. `layout`: the spans' (`varlen_layout`'s by default)."""
        kernels = fla_kernels()
        if kernels is None:
            raise RuntimeError("flash-linear-attention (the package fla-core) does not import")
        if layout is None:
            layout = varlen_layout(tuple(spans), mixed.device)
        mixed, conv = fla_conv(kernels, mixed, self.conv1d.weight.squeeze(1), conv, layout)
        t, key_dim = mixed.shape[0], self.hk * self.dk
        q, k, v = mixed.split((key_dim, key_dim, self.hv * self.dv), dim=-1)
        beta, g = self._gates(b, a)
        out, ssm = fla_delta_rule(kernels, q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk),
                                  v.view(t, self.hv, self.dv), g, beta, ssm, layout)
        return out, conv, ssm

    def mix_padded(self, mix_rows: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                   mix_one: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                   mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
                   ssm: torch.Tensor, pad: PadRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence of B rows whose first n are tokens (a captured prompt step, `PadRows`):
        `mix_rows` (a `mix_spans_*`) reads the rows before the last token, `mix_one` the last
        token from the state they leave, which goes to `pad.kept` (the checkpoint one token
        before a prompt's end): the arithmetic of `mix_cut` with a cut at n - 1.

        In the first pass the rows from n - 1 on have b and a of -inf, so beta = sigmoid(b) = 0
        and g = -A softplus(a) = 0: each decays the matrix state by exp(0) = 1 and corrects it
        by a zero multiple, exactly; the rows before them never read them (causal). The
        convolution's tail before the last token is the K-1 inputs before row n - 1 (the old
        tail, then the rows), gathered by the device index."""
        rows = mixed.shape[0]
        later = ~pad.head[:, None]
        out, _, ssm_cut = mix_rows(mixed, b.masked_fill(later, float("-inf")), a.masked_fill(later, float("-inf")),
                                   conv, ssm, [(0, rows)])
        inputs = torch.cat((conv, mixed.T[None].float()), dim=2)  # [1, C, K-1 + B]
        conv_cut = inputs.index_select(2, pad.last + torch.arange(self.kernel - 1, device=mixed.device))
        pad.kept[self.layer_index] = {"conv": conv_cut[0], "ssm": ssm_cut[0]}
        last = pad.last
        o, conv, ssm = mix_one(mixed.index_select(0, last), b.index_select(0, last), a.index_select(0, last),
                               conv_cut, ssm_cut, [(0, 1)])
        return out.index_copy(0, last, o), conv, ssm

    def forward(self, x: torch.Tensor, states: StateContext | None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: each span of `states` continues its sequence's state.

        bf16 / fp16 on CUDA with `fla` installed, the spans run through FLA's kernels, else
        through the torch code (`deltanet_fla.backend_for`); a step with verified runs of drafts
        runs the torch code (`mix_runs`), which keeps each run's state after every row; a step
        with cut points inside its prompt pieces computes them in parts (`mix_cut`).
        """
        if states is None:
            raise ValueError("a gated DeltaNet layer needs a StateContext for its recurrent state")
        mixed, z, b, a = self._split(x)
        before = states.load(self.layer_index)
        if any(states.runs):
            if any(states.cuts):
                raise ValueError("a step verifies drafts or cuts prompts at checkpoints, not both")
            out, conv, ssm, after = self.mix_runs(mixed, b, a, before["conv"], before["ssm"], states.spans,
                                                  states.runs)
            for seq, run in after.items():
                states.keep_run(self.layer_index, seq, run)
        else:
            fla = backend_for(x.device, x.dtype) == "fla"
            if states.pad is not None:
                one = self.mix_spans_fla if fla else self.mix_spans_torch
                many = functools.partial(one, layout=states.pad.layout) if fla else one
                out, conv, ssm = self.mix_padded(many, one, mixed, b, a, before["conv"], before["ssm"], states.pad)
            elif any(states.cuts):
                cut = self.mix_cut_fla if fla else functools.partial(self.mix_cut, self.mix_spans_torch)
                out, conv, ssm = cut(mixed, b, a, before["conv"], before["ssm"], states)
            else:
                mix = self.mix_spans_fla if fla else self.mix_spans_torch
                out, conv, ssm = mix(mixed, b, a, before["conv"], before["ssm"], states.spans)
        states.save(self.layer_index, {"conv": conv, "ssm": ssm})
        out = self.norm.forward(out, z).reshape(x.shape[0], -1)
        return self.out_proj.forward(out)
