"""What the cut-point tests of the DeltaNet paths share: a StateContext stub that records the states
handed over at cuts, and each sequence read alone in steps ending at its cuts (the reference)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


class CutStates:
    """The part of a StateContext `mix_cut` reads: spans, cut rows, and the states handed over."""

    def __init__(self, spans: list[tuple[int, int]], cuts: list[tuple[int, ...]]) -> None:
        self.spans, self.cuts = spans, cuts
        self.pad = None
        self.kept: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def keep_cut(self, layer: int, seq: int, rows: int, state: dict[str, torch.Tensor]) -> None:
        self.kept[(seq, rows)] = state


def parts_read_alone(mix: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]], mixed: torch.Tensor,
                     b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                     ctx: CutStates, shift: int = 0
                     ) -> Iterator[tuple[int, slice, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Sequence i read by `mix` (a `mix_spans_*`) alone in steps ending at its cuts, each moved
    `shift` rows later (the control): (i, the part's rows, rows done, its output, conv and matrix
    state after it), part by part."""
    for i, ((start, rows), at) in enumerate(zip(ctx.spans, ctx.cuts)):
        sc, ss = conv[i : i + 1], ssm[i : i + 1]
        bounds = [0, *(x + shift for x in at if x + shift < rows), rows]
        for lo, hi in zip(bounds, bounds[1:]):
            r = slice(start + lo, start + hi)
            o, sc, ss = mix(mixed[r], b[r], a[r], sc, ss, [(0, hi - lo)])
            yield i, r, hi, o, sc[0], ss[0]
