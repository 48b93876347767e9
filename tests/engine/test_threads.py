"""CPU threads: the cores found (affinity, cgroup quota), the governor's choices, and exactness
when the count changes in the middle of a generation."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from strata.engine.config import EngineConfig, add_engine_arguments, config_from_args
from strata.engine.engine import Engine
from strata.engine.threads import (
    Cores,
    CpuThreads,
    GovernorSettings,
    ThreadGovernor,
    cgroup_quota,
    find_cores,
    ladder,
    openmp_runtimes,
    parse_cpu_max,
    parse_threads,
    release_openmp_pool,
)
from strata.engine.types import SamplingParams

# ---- the cores found --------------------------------------------------------------


def test_quota_rounds_up_and_never_exceeds_the_affinity_mask() -> None:
    assert Cores(2, None).threads == 2
    assert Cores(8, 1.5).threads == 2
    assert Cores(8, 2.0).threads == 2
    assert Cores(2, 6.0).threads == 2
    assert Cores(4, 0.25).threads == 1


def test_cpu_max_forms() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cpu_max("50000 100000") == 0.5


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_the_process_cgroup_and_above(tmp_path: Path) -> None:
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/app/worker\n")
    root = tmp_path / "cg"
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "app" / "cpu.max", "300000 100000\n")
    _write(root / "app" / "worker" / "cpu.max", "max 100000\n")
    assert cgroup_quota(root, proc) == 3.0  # the parent's limit holds for its children
    _write(root / "app" / "worker" / "cpu.max", "150000 100000\n")
    assert cgroup_quota(root, proc) == 1.5  # the tightest one


def test_cgroup_v2_in_a_container_reads_the_mount_root(tmp_path: Path) -> None:
    """The listed path does not exist under a container's mount: its root is the container's cgroup."""
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/kubepods/pod1/abc\n")
    root = tmp_path / "cg"
    _write(root / "cpu.max", "200000 100000\n")
    assert cgroup_quota(root, proc) == 2.0


def test_cgroup_v1_quota_and_none(tmp_path: Path) -> None:
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/x\n2:cpu,cpuacct:/job\n0::/\n")
    root = tmp_path / "cg"
    _write(root / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us", "250000\n")
    _write(root / "cpu,cpuacct" / "job" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_quota(root, proc) == 2.5
    _write(root / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_quota(root, proc) is None
    assert cgroup_quota(tmp_path / "nothing", tmp_path / "no_proc_file") is None


def test_threads_flag() -> None:
    assert parse_threads("auto") is None
    assert parse_threads("3") == 3
    for bad in ("0", "-2", "many"):
        with pytest.raises(ValueError):
            parse_threads(bad)


def test_threads_flag_on_the_command_line() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    assert config_from_args(ap.parse_args([])).threads is None
    assert config_from_args(ap.parse_args(["--threads", "auto"])).threads is None
    assert config_from_args(ap.parse_args(["-t", "3"])).threads == 3
    with pytest.raises(SystemExit):
        ap.parse_args(["--threads", "0"])


def test_ladder() -> None:
    assert ladder(1) == [1]
    assert ladder(2) == [2, 1]
    assert ladder(8) == [8, 7, 4, 2, 1]


# ---- the governor -------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(gov: ThreadGovernor, clock: Clock, cost: dict[int, float], steps: int,
        rows: int = 1) -> list[int]:
    """`steps` decode steps, each taking cost[threads] seconds; the count of every step."""
    used = []
    for _ in range(steps):
        n = gov.threads
        used.append(n)
        clock.t += cost[n]
        gov.record(cost[n], rows)
    return used


QUIET = {2: 0.009, 1: 0.016}  # the default model's decode step on 2 cores, quiet
BUSY = {2: 0.077, 1: 0.016}  # one core kept busy by another process


def test_quiet_machine_stays_at_the_full_count() -> None:
    clock = Clock()
    gov = ThreadGovernor(2, clock)
    used = run(gov, clock, QUIET, 3000)  # about 30 s
    assert gov.current == 2 and gov.switches == 0
    assert gov.probes >= 3  # it keeps checking ...
    assert used.count(1) / len(used) < 0.02  # ... at a small cost


def test_contention_moves_to_one_thread_and_back_when_it_ends() -> None:
    clock = Clock()
    gov = ThreadGovernor(2, clock)
    run(gov, clock, QUIET, 500)
    assert gov.current == 2
    used = run(gov, clock, BUSY, 600)  # one core taken
    assert gov.current == 1 and gov.switches == 1
    first_one = used.index(1)
    assert first_one < 20  # the slowdown starts a probe at once, not at the next interval
    slow = sum(BUSY[n] for n in used)
    assert len(used) / slow > 0.5 / QUIET[2]  # at least half the quiet speed, probes included
    run(gov, clock, QUIET, 3000)  # the other process ends: back up within the longest wait
    assert gov.current == 2 and gov.switches == 2


def test_starting_under_contention_switches_within_a_few_steps() -> None:
    clock = Clock()
    gov = ThreadGovernor(2, clock)
    used = run(gov, clock, BUSY, 20)
    assert used[-10:] == [1] * 10


def test_one_slow_step_does_not_decide_a_probe_at_fewer_threads() -> None:
    clock = Clock()
    gov = ThreadGovernor(2, clock)
    at_one = 0
    for _ in range(40):
        n = gov.threads
        at_one += n == 1
        cost = 0.5 if n == 1 and at_one == 2 else BUSY[n]  # the first measured probe step: a hiccup
        clock.t += cost
        gov.record(cost, 1)
    assert gov.current == 1 and gov.switches == 1 and gov.probes == 1


def test_a_lower_count_must_be_clearly_faster() -> None:
    """Within the margin, the higher count stays; just beyond it, the lower one wins, and stays."""
    clock = Clock()
    gov = ThreadGovernor(2, clock, GovernorSettings(margin=0.15))
    run(gov, clock, {2: 0.010, 1: 0.0090}, 2000)
    assert gov.current == 2 and gov.switches == 0
    gov = ThreadGovernor(2, clock, GovernorSettings(margin=0.15))
    run(gov, clock, {2: 0.010, 1: 0.0080}, 2000)
    assert gov.current == 1 and gov.switches == 1  # no flapping: upward probes keep losing


def test_steps_of_another_shape_are_not_compared() -> None:
    """A probe at one lane is held against one-lane steps only, whatever else runs meanwhile."""
    clock = Clock()
    gov = ThreadGovernor(2, clock)
    cost = {(2, 1): 0.009, (1, 1): 0.016, (2, 4): 0.020, (1, 4): 0.030}
    for i in range(4000):
        rows = 1 if i % 3 else 4
        n = gov.threads
        clock.t += cost[n, rows]
        gov.record(cost[n, rows], rows)
    assert gov.current == 2 and gov.switches == 0 and gov.probes > 0


def test_probes_back_off_while_they_lose() -> None:
    clock = Clock()
    gov = ThreadGovernor(2, clock, GovernorSettings(interval_s=2.0, max_interval_s=16.0))
    run(gov, clock, BUSY, 100)
    assert gov.current == 1
    probes, t = gov.probes, clock.t
    run(gov, clock, BUSY, 4000)  # 64 s more
    assert gov.probes - probes <= 64 / 16 + 4  # 2, 4, 8, then every 16 s
    assert clock.t - t > 60


def test_one_core_is_never_governed() -> None:
    clock = Clock()
    gov = ThreadGovernor(1, clock)
    assert run(gov, clock, {1: 0.01}, 100) == [1] * 100 and gov.probes == 0


def test_cpu_threads_applies_only_changes_and_only_decode_steps_count() -> None:
    class Seq:
        def __init__(self, n: int) -> None:
            self.n = n

    applied: list[int] = []
    clock = Clock()
    ct = CpuThreads(Cores(2, None), None, applied.append, clock)
    ct.govern()
    assert applied == [2]
    for _ in range(50):
        started = clock()
        clock.t += BUSY[ct.applied]
        ct.step_done(started, [Seq(1)])
    assert ct.applied == 1 and applied[:2] == [2, 1] and len(applied) < 10
    assert ct.figures()["cpu_thread_switches"] == 1
    gov = ct.governor
    assert gov is not None
    seen = gov.probes
    ct.step_done(clock(), [Seq(512)])  # a prompt chunk is not recorded
    assert gov.probes == seen
    forced = CpuThreads(Cores(2, None), 1, applied.append, clock)
    forced.govern()
    assert forced.governor is None and forced.figures()["cpu_threads"] == 1


# ---- exactness: a change of count mid-way changes no token ----------------------------


class Alternating:
    """A governor stand-in that changes the count after every step."""

    def __init__(self, counts: tuple[int, ...]) -> None:
        self.counts, self.i = counts, 0
        self.switches = self.probes = 0

    @property
    def threads(self) -> int:
        return self.counts[self.i % len(self.counts)]

    def record(self, seconds: float, rows: int) -> None:
        self.i += 1
        self.switches += 1


def _generate(loaded, threads: int | None, prompts: list[list[int]], switching: bool,
              parallel: int) -> tuple[list[list[int]], dict]:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with Engine(EngineConfig(max_context=256, parallel=parallel, threads=threads), loaded=loaded) as eng:
        if switching:
            def install() -> None:
                eng.cpu_threads.governor = Alternating((2, 1, 2, 2, 1))
            eng.call(install).result()
        handles = [eng.generate(p, params) for p in prompts]
        out = [h.result().token_ids for h in handles]
        return out, eng.stats()


PROMPTS = [[1, 504, 3287, 314, 7042, 30], [1, 1041, 253, 3301], [1, 9, 28, 77, 91, 1200, 5, 6]]


def test_switching_threads_mid_generation_changes_no_token(tiny_loaded) -> None:
    fixed, _ = _generate(tiny_loaded, 1, PROMPTS, False, parallel=3)
    switched, stats = _generate(tiny_loaded, None, PROMPTS, True, parallel=3)
    assert stats["cpu_thread_switches"] >= 10
    assert switched == fixed
    alone, _ = _generate(tiny_loaded, 2, PROMPTS[:1], False, parallel=1)
    assert alone[0] == fixed[0]


def test_stats_and_start_up_line_show_the_threads(tiny_loaded, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="strata.engine"):
        with Engine(EngineConfig(max_context=64, threads=1), loaded=tiny_loaded) as eng:
            s = eng.stats()
    assert s["cpu_threads"] == 1 and s["cpu_threads_max"] == 1 and s["cpu_threads_governed"] is False
    assert s["cpu_thread_switches"] == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU: "))
    assert "in the affinity mask" in line and "threads 1 (--threads)" in line
    cores = find_cores()
    with Engine(EngineConfig(max_context=64), loaded=tiny_loaded) as eng:
        s = eng.stats()
    assert s["cpu_threads_max"] == cores.threads
    assert s["cpu_threads_governed"] is (cores.threads > 1)


def test_metrics_show_the_threads_gauge_and_switch_counters() -> None:
    from strata.serve.metrics import ServeMetrics

    figures = CpuThreads(Cores(2, None), None, lambda n: None).figures()
    text = ServeMetrics(lambda: figures).render().decode()
    assert "# TYPE strata_engine_cpu_threads gauge" in text and "strata_engine_cpu_threads 2.0" in text
    assert "# TYPE strata_engine_cpu_thread_switches_total counter" in text
    assert "strata_engine_cpu_thread_probes_total 0.0" in text


@pytest.mark.slow
def test_default_model_switching_threads_changes_no_token() -> None:
    """The shipped model (int4 projections, the C++ kernels) under a count that keeps changing."""
    from strata.models import load_model

    loaded = load_model(None, device="cpu", dtype="bfloat16", weights="auto", progress=False)
    fixed, _ = _generate(loaded, 2, PROMPTS, False, parallel=3)
    switched, stats = _generate(loaded, None, PROMPTS, True, parallel=3)
    assert stats["cpu_thread_switches"] >= 10
    assert switched == fixed


def test_openmp_runtimes_are_read_from_the_process_maps() -> None:
    maps = ("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n"
            "7f10-7f20 r-xp 0 08:01 2 /venv/torch/lib/libgomp.so.1\n"
            "7f20-7f30 r--p 0 08:01 2 /venv/torch/lib/libgomp.so.1\n"
            "7f30-7f40 r-xp 0 08:01 3 /opt/intel/libiomp5.so\n"
            "7f40-7f50 rw-p 0 00:00 0 [heap]\n")
    assert openmp_runtimes(maps) == ["/opt/intel/libiomp5.so", "/venv/torch/lib/libgomp.so.1"]
    assert openmp_runtimes("7f40-7f50 rw-p 0 00:00 0 [stack]\n") == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads the process's threads and mappings in /proc")
def test_the_callers_openmp_workers_go() -> None:
    """After a parallel torch operation this thread owns an OpenMP pool (threads - 1 worker
    threads); `release_openmp_pool` lets them go, as the engine's constructor does for its caller
    (libgomp stops spinning once it has more workers than cores: docs/PERFORMANCE.md)."""
    assert openmp_runtimes(), "torch's OpenMP runtime is not among the process's mappings"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a pool of one worker even on one core
    try:
        torch.ones(1 << 22).add_(1)  # a parallel region on this thread
        before = len(os.listdir("/proc/self/task"))
        assert release_openmp_pool() >= 1
        deadline = time.monotonic() + 5
        while len(os.listdir("/proc/self/task")) >= before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/task")) < before
    finally:
        torch.set_num_threads(threads)
