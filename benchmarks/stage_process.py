"""`strata stage` as a child process, for benchmarks and tests: start it, learn its address.

Its log goes to a file (nobody has to drain a pipe); `address` comes from the
"listening on HOST:PORT" line once it listens. The child's environment keeps
NVLink multicast off (docs/GPU.md: the device machines require it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class StageProcess:
    """`strata stage --listen 127.0.0.1:PORT FLAGS...` (port 0: one the system picks)."""

    def __init__(self, flags: list[str], log_file: Path, port: int = 0, timeout: float = 120) -> None:
        cmd = [sys.executable, "-m", "strata.cli", "stage", "--listen", f"127.0.0.1:{port}", *flags]
        self.log_file = log_file
        with log_file.open("w") as log:
            self.proc = subprocess.Popen(cmd, stderr=log, stdout=subprocess.DEVNULL,
                                         env={**os.environ, **NO_MULTICAST})
        line = self.wait_for("listening on", timeout)
        self.address = re.search(r"listening on (\S+)", line).group(1)  # type: ignore[union-attr]
        self.port = int(self.address.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float, count: int = 1) -> str:
        """The log line holding the `count`-th `text`; raises with the log's tail if it does not come."""
        end = time.monotonic() + timeout
        while True:
            lines = [line for line in self.log().splitlines() if text in line]
            if len(lines) >= count:
                return lines[count - 1]
            if time.monotonic() > end or self.proc.poll() is not None:
                raise RuntimeError(f"no {text!r} from strata stage: {self.log()[-2000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
