"""Compiling the kernels for sm_90 (the H200) on a machine without a GPU.

A stand-in driver names the target and a JIT cache hook records each launch's
specialization instead of launching; `triton.compile` then runs the whole
pipeline down to ptxas (shipped with Triton), which reports registers and
spills. What fails here would fail on the device.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.driver import driver

TARGET = GPUTarget("cuda", 90, 32)


class _Sm90Driver:
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")


@dataclass
class Compiled:
    name: str
    registers: int
    spill_bytes: int
    ptx: str


def launches(run: Callable[[], None]) -> list[dict]:
    """The compile requests of the kernels `run` launches (CPU tensors; nothing runs)."""
    seen: list[dict] = []

    def hook(**kw: Any) -> bool:
        seen.append(kw)
        return True  # compile nothing, launch nothing

    old_hook, old_driver = knobs.runtime.jit_cache_hook, driver._active
    driver.set_active(_Sm90Driver())  # type: ignore[arg-type]
    knobs.runtime.jit_cache_hook = hook
    try:
        run()
    finally:
        knobs.runtime.jit_cache_hook = old_hook
        driver._active = old_driver  # not reset_active(): it would look for a real GPU
    return seen


def compile_sm90(request: dict) -> Compiled:
    """Compile one recorded launch for sm_90; ptxas's register and spill figures."""
    c = request["compile"]
    fn = request["fn"].jit_function
    src = ASTSource(fn, c["signature"], c["constants"], c["configs"][0])
    opts = {k: c[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion")}
    ptx = triton.compile(src, target=TARGET, options=opts).asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return Compiled(fn.__name__, int(regs.group(1)) if regs else -1,
                    int(spills.group(1)) if spills else 0, ptx)
