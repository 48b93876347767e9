"""K or V of one layer as the attention kernels read it: one of three encodings, two tensors.

The formats that produce these views live in `strata/kv/formats.py`;
`strata/attention/layout.py` maps a format's named runs onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.triton.cells import INT8, PLAIN, Q4_0


@dataclass(frozen=True)
class Half:
    """K or V of one layer as a kernel reads it."""

    kind: int  # PLAIN, INT8 or Q4_0
    data: torch.Tensor  # the values (plain), codes (int8) or Q4_0 bytes
    aux: torch.Tensor  # int8 scales, the Q4_0 bytes viewed as float16, or `data` again (plain)

    def args(self) -> tuple:
        """(data, aux, data cell stride, data head stride, aux cell stride, aux head stride)."""
        d, a = self.data, self.aux
        return (d, a, d.stride(0), d.stride(1), a.stride(0), a.stride(1))


def plain_half(t: torch.Tensor) -> Half:
    return Half(PLAIN, t, t)


def int8_half(codes: torch.Tensor, scales: torch.Tensor) -> Half:
    return Half(INT8, codes, scales)


def q4_0_half(blocks: torch.Tensor) -> Half:
    return Half(Q4_0, blocks, blocks.view(torch.float16))
