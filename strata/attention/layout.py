"""Which kernel variant reads a format's runs, and the pointers and strides it needs.

The formats (`strata.kv.formats`) describe a cell as named runs; a kernel
wants, for K and for V separately, one of three encodings plus two tensors
and their strides. This is the one place that knows how the two views line
up, so adding a format means one entry here, not a new kernel.
"""

from __future__ import annotations

from strata.kernels.triton.half import Half, int8_half, plain_half, q4_0_half
from strata.kv.formats import Int8Format, K8V4Format, KvFormat, PlainFormat, Q4_0Format, Storage


def halves(fmt: KvFormat, storage: Storage) -> tuple[Half, Half]:
    """(K, V) of one layer's storage; TypeError for a format no kernel reads."""
    if isinstance(fmt, PlainFormat):
        return plain_half(storage["k"]), plain_half(storage["v"])
    if isinstance(fmt, Int8Format):
        return int8_half(storage["k_q"], storage["k_s"]), int8_half(storage["v_q"], storage["v_s"])
    if isinstance(fmt, Q4_0Format):
        return q4_0_half(storage["k_q4"]), q4_0_half(storage["v_q4"])
    if isinstance(fmt, K8V4Format):
        return int8_half(storage["k_q"], storage["k_s"]), q4_0_half(storage["v_q4"])
    raise TypeError(f"no GPU attention kernel reads the {fmt.name!r} KV format")


def supported(fmt: KvFormat) -> bool:
    return isinstance(fmt, (PlainFormat, Int8Format, Q4_0Format, K8V4Format))
