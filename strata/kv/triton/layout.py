"""Which kernel variant reads a format's runs, and the pointers and strides it needs.

The formats (`strata.kv.formats`) describe a cell as named runs; a kernel
wants, for K and for V separately, one of three encodings plus two tensors
and their strides. This is the one place that knows how the two views line
up, so adding a format means one entry here, not a new kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kv.formats import Int8Format, K8V4Format, KvFormat, PlainFormat, Q4_0Format, Storage
from strata.kv.triton.cells import INT8, PLAIN, Q4_0


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


def _plain(t: torch.Tensor) -> Half:
    return Half(PLAIN, t, t)


def _int8(codes: torch.Tensor, scales: torch.Tensor) -> Half:
    return Half(INT8, codes, scales)


def _q4_0(blocks: torch.Tensor) -> Half:
    return Half(Q4_0, blocks, blocks.view(torch.float16))


def halves(fmt: KvFormat, storage: Storage) -> tuple[Half, Half]:
    """(K, V) of one layer's storage; TypeError for a format no kernel reads."""
    if isinstance(fmt, PlainFormat):
        return _plain(storage["k"]), _plain(storage["v"])
    if isinstance(fmt, Int8Format):
        return _int8(storage["k_q"], storage["k_s"]), _int8(storage["v_q"], storage["v_s"])
    if isinstance(fmt, Q4_0Format):
        return _q4_0(storage["k_q4"]), _q4_0(storage["v_q4"])
    if isinstance(fmt, K8V4Format):
        return _int8(storage["k_q"], storage["k_s"]), _q4_0(storage["v_q4"])
    raise TypeError(f"no GPU attention kernel reads the {fmt.name!r} KV format")


def supported(fmt: KvFormat) -> bool:
    return isinstance(fmt, (PlainFormat, Int8Format, Q4_0Format, K8V4Format))
