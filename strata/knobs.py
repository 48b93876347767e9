"""Every environment knob Strata reads, in one typed list.

These are fallbacks and comparisons, not configuration: a user sets the
engine through `EngineConfig` (the command line). A knob switches a kernel
family off (to compare it with the torch path, or to step around a broken
driver) or picks between two exact ways of doing one thing. Each is read
when its code first needs it; `Engine.stats()["knobs"]` shows the values in
effect. An unknown value is an error naming the knob, not a silent default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    name: str  # the environment variable
    default: bool | int | None  # None: a text knob, unset by default
    doc: str


KNOBS: tuple[Knob, ...] = (
    Knob("STRATA_CPU_KERNEL", True,
         "0: the CPU runs attention and the row-wise layer pieces in plain torch instead of "
         "Strata's C++ kernels (the reference path; tests compare the two)"),
    Knob("STRATA_GPU_FUSED", True,
         "0: CUDA tensors take the torch expressions instead of the Triton row-wise kernels "
         "(RMSNorm, residual add, RoPE, SiLU times up)"),
    Knob("STRATA_GPU_GEMV", True,
         "0: one-lane CUDA decode uses cuBLAS and separate row-wise ops instead of the one-row "
         "matrix-vector kernels that carry them"),
    Knob("STRATA_GPU_PDL", True,
         "0: no programmatic dependent launch for the one-row kernels (Hopper and later)"),
    Knob("STRATA_STREAM_OVERLAP", True,
         "0: streamed K/V on CUDA copies each layer's misses, then waits, instead of copying "
         "them on a side stream while earlier layers compute"),
    Knob("STRATA_STREAM_GATHER", True,
         "0: streamed K/V on CUDA copies misses with one copy_ per run of blocks instead of one "
         "gather launch per layer reading the pinned store in place"),
    Knob("STRATA_GATHER_PROGRAMS", 0,
         "programs of one gather launch; 0: one per multiprocessor"),
    Knob("STRATA_API_KEY", None,
         "the key `strata serve` requires when --api-key is not given (so it need not appear in "
         "a process list); an empty value is refused at start-up"),
)
_BY_NAME = {k.name: k for k in KNOBS}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def knob(name: str) -> bool | int | str | None:
    """The value of knob `name` now: the environment's, else its default (a text knob's value is
    the environment's text as it is, an empty one included)."""
    k = _BY_NAME[name]
    raw = os.environ.get(name)
    if k.default is None:
        return raw
    if raw is None or raw.strip() == "":
        return k.default
    text = raw.strip().lower()
    if isinstance(k.default, bool):
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r}: use 0 or 1")
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not an integer") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: must be 0 or more")
    return value


def flag(name: str) -> bool:
    """A boolean knob's value."""
    value = knob(name)
    assert isinstance(value, bool), name
    return value


def text(name: str) -> str | None:
    """A text knob's value, None where it is not set."""
    value = knob(name)
    assert value is None or isinstance(value, str), name
    return value


SECRET = ("STRATA_API_KEY",)  # shown as whether they are set, never their value


def knob_values() -> dict[str, bool | int | str | None]:
    """Every knob's value in effect (for `Engine.stats()`); secrets as "set" or None."""
    return {k.name: ("set" if knob(k.name) is not None else None) if k.name in SECRET
            else knob(k.name) for k in KNOBS}
