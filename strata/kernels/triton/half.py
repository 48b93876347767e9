"""K or V of one layer as the attention kernels read it: one of three encodings, two tensors.

No Triton here: the selection rule (attention/select.py) asks which formats
the kernels read on machines without Triton too.

The formats that produce these views live in `strata/kv/formats.py`;
`strata/attention/layout.py` maps a format's named runs onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLAIN = 0  # values stored as they are (fp32 / fp16 / bf16)
INT8 = 1  # int8 codes [cells, Hkv, D] with float32 scales [cells, Hkv]
Q4_0 = 2  # ggml Q4_0 blocks [cells, Hkv, D/32, 18] (float16 d, then 16 bytes of nibbles)


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
