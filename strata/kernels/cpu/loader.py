"""Strata's C++ CPU kernels (`csrc/`): built once per machine, then loaded.

`attend` (attention over the pool's cells, `attention.py`) and the row-wise
pieces of a decoder layer (`elementwise.cpp`, used through `models/ops.py`),
`block_matmul` (`blocks.cpp`, bf16/fp16 x through `blocks_fixed.cpp`): x @
W.T with W in a GGUF file's own quantized blocks, for the types in
`BLOCK_TYPES`, `BlockLayer` (`block_layer.cpp`): a dense layer over
such blocks in one call, and `experts_dense` / `experts_blocks` (`experts.cpp`): a MoE
layer's routed experts in one call.

torch compiles it on first use with the machine's C++ compiler (about a
minute on 2 cores) and caches the build under torch's extensions folder;
later processes load it in well under a second. Where no compiler is found
the reference attention in torch is used instead, with one warning.
`STRATA_CPU_KERNEL=0` turns the kernel off (tests compare the two).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from strata.knobs import flag

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / "csrc" / f
           for f in ("module.cpp", "attention.cpp", "elementwise.cpp", "blocks.cpp", "blocks_fixed.cpp",
                     "block_layer.cpp", "experts.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / f for f in ("block_types.h", "kernels.h")]
# -ffp-contract=off: a*b+c rounds twice, as the torch expressions the row-wise kernels replace
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
# gguf.GGMLQuantizationType values `block_matmul` takes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K
# ... Q6_K), here so that callers can route a tensor without building the kernel first;
# the kernel's `block_types()` gives the same list
BLOCK_TYPES: frozenset[int] = frozenset({2, 3, 6, 7, 8, 10, 11, 12, 13, 14})


def _machine_tag() -> str:
    """Builds use -march=native: one build per CPU model, torch installation, flags and source."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
                if line.startswith("flags"):
                    break
    except OSError:
        flags = platform.processor()
    # the folder too: ninja rebuilds whenever one build folder is shared by two checkouts
    text = (flags + torch.__version__ + torch.__file__ + " ".join(CFLAGS) + str(SOURCES[0].parent)
            + "".join(p.read_text() for p in SOURCES + HEADERS))
    h = hashlib.sha256(text.encode()).hexdigest()
    return h[:12]


STALE_LOCK_S = 1800  # a build holds its lock for minutes; one left older than this was killed


def _drop_stale_lock(lock: Path) -> None:
    """torch waits forever on the lock file of a build that was killed (Ctrl-C during the first
    compile): every later start would hang. One older than any build is removed, loudly."""
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing the lock of a CPU kernel build that was interrupted %.0f minutes ago (%s)",
                    age / 60, lock)
        lock.unlink(missing_ok=True)


@functools.lru_cache(maxsize=1)
def cpu_kernel() -> Any | None:
    """The loaded extension module, or None when it is turned off or cannot be built."""
    if not flag("STRATA_CPU_KERNEL"):
        return None
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # torch builds with ninja; the pip package carries one
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        name = f"strata_cpu_kernels_{_machine_tag()}"
        build = Path(cpp_extension._get_build_directory(name, verbose=False))
        _drop_stale_lock(build / "lock")
        if not (build / f"{name}.so").exists():
            print("strata: compiling the CPU kernels (once per machine, about a minute)",
                  file=sys.stderr, flush=True)
        return cpp_extension.load(
            name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler or headers: fall back, loudly
        log.warning("CPU kernels unavailable (%s); using the torch reference code",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
