"""The HTTP processes step back for their engine core process on a host with few CPUs.

Every engine step holds up every stream, whereas the HTTP side can fall behind a little and
catch up in one go (its output thread delivers several steps at once). On a 2-vCPU host the
core, its HTTP worker and anything else (a load generator, a sidecar) want more CPU than there
is, and a core that waits for a CPU waits with all its sequences: there, the HTTP threads at
niceness 19 raised served req/s by 31-51 % with the same time to first byte
(docs/benchmark/cpu-2026-11-26-nice/). With a single CPU the HTTP side would starve instead
(it must hand the core its requests), so `auto` steps back only where the host has a CPU for
the core besides one per HTTP process.

Linux keeps a niceness per thread, and a new thread takes its starter's, so every thread of
the process is set once, after the core process has started (it keeps its own)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_NICE = 19
CGROUP = Path("/sys/fs/cgroup")


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (a
    container started with --cpus)."""
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0))
    else:
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return max(1, cpus if quota is None else min(cpus, math.ceil(quota)))


def _cgroup_quota(cgroup: Path) -> float | None:
    """CPUs' worth of time per period the cgroup allows (v2 cpu.max, else v1's pair); None
    when unlimited or unreadable."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def resolve_nice(setting: int | None, api_server_count: int, cpus: int) -> int:
    """The niceness increment for the HTTP threads: `setting`, or for auto (None) MAX_NICE
    where the host has a CPU for the core besides one per HTTP process, else 0."""
    if setting is not None:
        return setting
    return MAX_NICE if cpus > api_server_count else 0


def step_back(increment: int, task_dir: Path = Path("/proc/self/task")) -> int:
    """Raise the niceness of every thread of this process by `increment` (capped at
    MAX_NICE); returns how many threads it found. Where threads cannot be listed (not Linux),
    it logs why and sets none."""
    if increment <= 0:
        return 0
    seen: set[int] = set()
    for _ in range(3):  # again for threads started by a thread not yet set
        try:
            new = {int(name) for name in os.listdir(task_dir)} - seen
        except OSError as err:
            logger.warning("the HTTP threads keep their CPU priority: cannot list them (%s)",
                           err)
            return 0
        if not new:
            break
        seen |= new
        for tid in new:
            _lower(tid, increment)
    return len(seen)


def _lower(tid: int, increment: int) -> None:
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, current + increment))
    except ProcessLookupError:  # it ended meanwhile
        pass
    except OSError as err:
        logger.warning("thread %d keeps its CPU priority: %s", tid, err)


def step_back_for_core(setting: int | None, api_server_count: int) -> None:
    """Lower this HTTP process's threads below its engine core process (`setting`: the
    option.api_server_nice value, None for auto), and log what was done."""
    cpus = usable_cpus()
    increment = resolve_nice(setting, api_server_count, cpus)
    threads = step_back(increment)
    how = "auto" if setting is None else str(setting)
    if threads:
        logger.info("HTTP threads at niceness +%d (%d threads; option.api_server_nice=%s, %d "
                    "usable CPUs): the engine core process gets a CPU first", increment,
                    threads, how, cpus)
    else:
        logger.info("HTTP threads keep their CPU priority (option.api_server_nice=%s, %d usable "
                    "CPUs for %d HTTP process(es) and the engine core)", how, cpus,
                    api_server_count)
