"""How many CPU threads torch and Strata's C++ kernels run on: the cores found, then governed.

Two parts. `find_cores` reads what this process may use: its affinity mask
(`os.sched_getaffinity`) and its cgroup's CPU quota (v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`); the default thread count is the
smaller of the two (the quota rounded up). `--threads N` forces N instead.

Having the cores is not the same as getting them. With two threads on two
cores and one core kept busy by another process, each OpenMP barrier waits
for the thread that is descheduled, and decode of the default model fell
from about 110 tokens/s to 13, where one thread gave 63 (docs/PERFORMANCE.md,
"CPU threads under contention"). `ThreadGovernor` decides, from the wall
time of the engine's decode steps alone, which count is faster now: every
so often it runs a few steps at the next count on a ladder (full, full-1,
full/2, ... 1), holds their median against the median of recent steps at
the current count of the same shape, and keeps the lower count only when it
is clearly faster. It is pure (an injected clock, no torch); `CpuThreads`
is the one place that applies a count (`torch.set_num_threads`, which also
sets OpenMP's count for the C++ kernels' `#pragma omp parallel`).

One pool of workers: OpenMP keeps one for each thread that ran a parallel
region, and with more workers than cores libgomp stops spinning between
regions, which doubled a decode step (docs/PERFORMANCE.md, "A quiet run on
an AVX-512 host"). So the engine loads the model on its own thread, and
once it is up the constructor lets go of the calling thread's pool
(`release_openmp_pool`: OpenMP 5's `omp_pause_resource_all`), which a caller
that loaded or wrote a model itself, a benchmark or a test, still holds: a
hybrid model's 4,096-token prompt read took 4.4 s on 2 cores with that
pool alive and 2.6 s without it (docs/PERFORMANCE.md).

A lane's output does not depend on the thread count (the CPU path is
thread-invariant: tests/engine/test_threads.py), so a switch changes speed only.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterable

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


# ---- the calling thread's OpenMP workers -----------------------------------------
OMP_PAUSE_SOFT = 1  # omp_pause_soft: threads go, the runtime stays usable


def openmp_runtimes(maps: str | None = None) -> list[str]:
    """Paths of the OpenMP runtimes this process has loaded (libgomp, LLVM's libomp, Intel's
    libiomp5), from /proc/self/maps (empty where there is none or no /proc)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    names = ("libgomp", "libomp", "libiomp5")
    return sorted({line.split()[-1] for line in maps.splitlines()
                   if "/" in line and any(n in line.rsplit("/", 1)[-1] for n in names)})


def release_openmp_pool() -> int:
    """Let the calling thread's OpenMP worker threads go (`omp_pause_resource_all`), in every
    OpenMP runtime loaded; they come back if this thread runs a parallel region again.
    Returns how many runtimes released them."""
    import ctypes

    released = 0
    for path in openmp_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # a runtime older than OpenMP 5.0
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released += pause(OMP_PAUSE_SOFT) == 0
    return released


# ---- the cores this process gets ------------------------------------------------
@dataclass(frozen=True)
class Cores:
    affinity: int  # CPUs in the affinity mask
    quota: float | None  # the cgroup's CPU limit in cores; None: no limit found

    @property
    def threads(self) -> int:
        """The default thread count: the affinity mask's CPUs, at most the quota rounded up."""
        n = self.affinity
        if self.quota is not None:
            n = min(n, math.ceil(self.quota - 1e-9))
        return max(1, n)

    def describe(self) -> str:
        quota = "no CPU quota" if self.quota is None else f"CPU quota {self.quota:g} cores"
        return f"{self.affinity} CPUs in the affinity mask, {quota}"


def parse_cpu_max(text: str) -> float | None:
    """Cores of a cgroup v2 `cpu.max` ("max 100000" or "QUOTA PERIOD"); None: no limit."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100_000
    quota = int(parts[0])
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """Cores of a cgroup v1 `cpu.cfs_quota_us` and `cpu.cfs_period_us` (-1: no limit)."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return quota / period if quota > 0 and period > 0 else None


def _ancestors(base: Path, path: str) -> list[Path]:
    """`base/path`, then each folder above it up to `base` (a limit anywhere above applies too)."""
    parts = [p for p in path.strip().split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 `cpu` controller path, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if fields[0] == "0" and fields[1] == "":
            v2 = fields[2]
        elif "cpu" in fields[1].split(","):
            v1 = fields[2]
    return v2, v1


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CPU quota (in cores) of this process's cgroup and those above it; None: none.

    cgroup v2 (`root/cpu.max`, or `root/unified/cpu.max` on a hybrid mount) first; v1's
    `cpu.cfs_quota_us` under `root/cpu` (or `cpu,cpuacct`) where v2 sets none. Inside a
    container the listed path may not exist under the mount (the container's cgroup is
    the mount's root), so the folders from the path up to the root are all read.
    """
    v2, v1 = _cgroup_paths(proc_cgroup)
    limits: list[float] = []
    for base in (root, root / "unified"):
        for folder in _ancestors(base, v2 or "/"):
            limit = _read(folder / "cpu.max", parse_cpu_max)
            if limit is not None:
                limits.append(limit)
    if not limits:
        for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            for folder in _ancestors(root / name, v1 or "/"):
                limit = _read(folder / "cpu.cfs_quota_us",
                              lambda q, f=folder: parse_cfs(q, (f / "cpu.cfs_period_us").read_text()))
                if limit is not None:
                    limits.append(limit)
    return min(limits) if limits else None


def _read(path: Path, parse: Callable[[str], float | None]) -> float | None:
    try:
        return parse(path.read_text())
    except (OSError, ValueError, IndexError):
        return None


def find_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> Cores:
    """The CPUs this process may run on and its cgroup's CPU quota."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call here (not Linux)
        affinity = os.cpu_count() or 1
    return Cores(affinity, cgroup_quota(root, proc_cgroup))


def parse_threads(text: str) -> int | None:
    """`--threads`: "auto" (None: the cores found, governed) or a count of 1 or more."""
    if text.strip().lower() == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"--threads takes auto or a count, not {text!r}") from None
    if n < 1:
        raise ValueError(f"--threads must be at least 1, got {n}")
    return n


# ---- the governor: which count is faster now ------------------------------------
@dataclass(frozen=True)
class GovernorSettings:
    interval_s: float = 2.0  # between probes at first (and after a probe that won)
    max_interval_s: float = 16.0  # each probe that loses doubles the wait, up to this
    baseline_steps: int = 8  # recent steps at the current count a probe is held against
    probe_steps: int = 4  # measured steps at the other count (after `warmup_steps`)
    warmup_steps: int = 1  # steps after a change of count that are not measured
    margin: float = 0.15  # the lower count is kept only when this much faster than the higher
    lose_factor: float = 2.5  # a probe at more threads ends at one step this much slower
    trigger: float = 1.5  # recent steps this much slower than at the last decision: probe now,
    trigger_gap_s: float = 0.25  # if the last probe began this long ago
    max_probe_steps: int = 64  # a probe that cannot collect its steps (other shapes) gives up


def ladder(full: int) -> list[int]:
    """The counts the governor moves between, highest first: full, full-1, full/2, full/4, ... 1."""
    rungs = {full, max(1, full - 1)}
    n = full
    while n > 1:
        n //= 2
        rungs.add(max(1, n))
    return sorted(rungs, reverse=True)


class ThreadGovernor:
    """Picks the thread count of the next step from the wall times of earlier ones.

    The engine calls `record(seconds, rows)` after each decode step (rows: the
    lanes decoded; steps that read prompt tokens are not recorded) and runs the
    next step on `threads`. Steps are compared only with steps of the same
    number of rows. A quiet machine stays at the full count: a lower count
    replaces a higher one only when its median step is `margin` faster.
    """

    def __init__(self, full: int, clock: Callable[[], float],
                 settings: GovernorSettings = GovernorSettings()) -> None:
        self.full = max(1, full)
        self.clock = clock
        self.s = settings
        self.rungs = ladder(self.full)
        self.current = self.full  # the chosen count
        self.trying: int | None = None  # the count a probe runs now
        self.switches = 0  # probes that changed the chosen count
        self.probes = 0
        self._baseline: dict[int, deque[float]] = {}  # rows -> recent step seconds at `current`
        self._reference: dict[int, float] = {}  # rows -> median step seconds at the last decision
        self._probe: list[float] = []
        self._probe_rows = 0
        self._probe_seen = 0  # steps of any shape since the probe began
        self._skip = 0  # steps not to measure (just after a change of count)
        self._interval = settings.interval_s
        self._next_probe = clock()  # the first probe comes as soon as there is a baseline
        self._last_probe = -math.inf
        self._upward = False  # which neighbour the next probe tries, where there are two

    @property
    def threads(self) -> int:
        """The count to run the next step on."""
        return self.trying if self.trying is not None else self.current

    def record(self, seconds: float, rows: int) -> None:
        """One decode step of `rows` rows took `seconds` at `threads` threads."""
        if len(self.rungs) == 1:
            return
        if self._skip > 0:
            self._skip -= 1
            if self.trying is not None:
                self._probe_seen += 1
            return
        if self.trying is not None:
            self._probe_step(seconds, rows)
            return
        recent = self._baseline.setdefault(rows, deque(maxlen=self.s.baseline_steps))
        recent.append(seconds)
        if len(recent) >= self.s.probe_steps and self._probe_due(recent, rows):
            self._start_probe(rows)

    # ---- inside -------------------------------------------------------------
    def _probe_due(self, recent: Iterable[float], rows: int) -> bool:
        now = self.clock()
        if now >= self._next_probe:
            return True
        ref = self._reference.get(rows)
        last = list(recent)[-self.s.probe_steps:]
        slowed = ref is not None and median(last) > self.s.trigger * ref
        return slowed and now - self._last_probe >= self.s.trigger_gap_s

    def _start_probe(self, rows: int) -> None:
        i = self.rungs.index(self.current)
        lower = self.rungs[i + 1] if i + 1 < len(self.rungs) else None
        upper = self.rungs[i - 1] if i > 0 else None
        if lower is not None and upper is not None:
            candidate = upper if self._upward else lower
            self._upward = not self._upward
        else:
            candidate = lower if lower is not None else upper
        assert candidate is not None
        self.trying = candidate
        self.probes += 1
        self._probe, self._probe_rows, self._probe_seen = [], rows, 0
        self._skip = self.s.warmup_steps
        self._last_probe = self.clock()

    def _probe_step(self, seconds: float, rows: int) -> None:
        self._probe_seen += 1
        if rows == self._probe_rows:
            self._probe.append(seconds)
        base = median(self._baseline[self._probe_rows])
        upward = self.trying is not None and self.trying > self.current
        if upward and rows == self._probe_rows and seconds > self.s.lose_factor * base:
            self._decide(won=False)  # more threads collapsing: stop paying for the probe now
        elif len(self._probe) >= self.s.probe_steps:
            self._decide(won=self._faster(median(self._probe), base))
        elif self._probe_seen >= self.s.max_probe_steps:
            self._decide(won=False)

    def _faster(self, probe: float, base: float) -> bool:
        """Whether the probed count beats the current one: a lower count must be `margin` faster."""
        assert self.trying is not None
        if self.trying < self.current:
            return probe < (1 - self.s.margin) * base
        return not base < (1 - self.s.margin) * probe

    def _decide(self, won: bool) -> None:
        assert self.trying is not None
        rows = self._probe_rows
        if won:
            self.current = self.trying
            self.switches += 1
            self._baseline = {rows: deque(self._probe, maxlen=self.s.baseline_steps)}
            self._interval = self.s.interval_s
            self._upward = self.current < self.full  # after moving down, look back up first
        else:
            self._interval = min(2 * self._interval, self.s.max_interval_s)
            self._skip = self.s.warmup_steps  # the first step back at the current count
        recent = self._baseline.get(rows)
        if recent:
            self._reference = {rows: median(recent)}
        self.trying = None
        self._next_probe = self.clock() + self._interval


# ---- the one place that applies a count -------------------------------------------
class CpuThreads:
    """The engine's thread count: set once (forced, or one core), or governed step by step.

    `apply` is `torch.set_num_threads`, called on the engine's thread (OpenMP's
    count is per thread); it is called only when the count changes.
    """

    def __init__(self, cores: Cores, forced: int | None, apply: Callable[[int], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.cores = cores
        self.forced = forced
        self.full = forced if forced is not None else cores.threads
        self.apply = apply
        self.clock = clock
        self.governor: ThreadGovernor | None = None
        self.applied = self.full
        apply(self.full)

    def govern(self) -> None:
        """Let the governor choose from now on (auto threads, more than one to choose from)."""
        if self.forced is None and self.full > 1:
            self.governor = ThreadGovernor(self.full, self.clock)

    def step_done(self, started: float, seqs: list[Any]) -> None:
        """After a step's forward: record a decode step's time, then set the next step's count."""
        gov = self.governor
        if gov is None:
            return
        if seqs and all(s.n == 1 for s in seqs):
            gov.record(self.clock() - started, len(seqs))
        if gov.threads != self.applied:
            self.applied = gov.threads
            self.apply(self.applied)

    def describe(self) -> str:
        """The start-up line: the cores found and the threads chosen."""
        if self.forced is not None:
            how = f"{self.forced} (--threads)"
        elif self.governor is not None:
            how = f"{self.full}, lowered while fewer run faster (--threads auto)"
        else:
            how = f"{self.full} (--threads auto)"
        return f"CPU: {self.cores.describe()}; threads {how}"

    def figures(self) -> dict[str, Any]:
        """For `Engine.stats()`: the count in use, the governor's switches and probes."""
        gov = self.governor
        return {"cpu_threads": self.applied, "cpu_threads_max": self.full,
                "cpu_thread_switches": gov.switches if gov else 0,
                "cpu_thread_probes": gov.probes if gov else 0,
                "cpu_threads_governed": gov is not None}
