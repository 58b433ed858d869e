"""The HTTP processes step back for their engine core process on a host with few CPUs.

Every engine step holds up every stream, whereas the HTTP side can fall behind a little and
catch up in one go (its output thread delivers several steps at once). On a 2-vCPU host the
core, its HTTP worker and anything else (a load generator, a sidecar) want more CPU than there
is, and a core that waits for a CPU waits with all its sequences: there, the HTTP threads at
niceness 19 raised served req/s by 31-51 % with the same time to first byte
(docs/benchmark/cpu-2026-11-26-nice/). That was a model whose step costs ~20 µs per sequence,
as much as the HTTP side spends on the sequence's token. A real model's step costs a
millisecond or more per sequence: the HTTP side then needs a few percent of a CPU, there is
nothing to arbitrate, and behind the core's OpenMP threads its writes only come out in bursts
(docs/benchmark/cpu-2026-11-27-nice-auto/). So `auto` steps back only where the host has a
CPU for the core besides one per HTTP process (with a single CPU the HTTP side would starve,
and it must hand the core its requests) and the core's busy steps, measured while serving,
cost less than STEP_BACK_BELOW_SECONDS_PER_SEQUENCE per sequence. Busy: holding 8 sequences
or more (engine.config.BUSY_STEP_SEQUENCES; fewer only where max_rolling_batch_size is
smaller). A step of one sequence costs the tiny model ~500 µs, a full one ~20 µs each: a
server first tried by one client at a time would otherwise keep its priority for good, and
the host is only short of CPU when the batches are full.

Linux keeps a niceness per thread, and a new thread takes its starter's, so every thread of
the process is set at once (the core process, started before, keeps its own). Auto decides
once: lowering a niceness again needs a privilege (CAP_SYS_NICE) a container may lack."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import Gauges

logger = logging.getLogger(__name__)

MAX_NICE = 19
CGROUP = Path("/sys/fs/cgroup")
# Ten times the HTTP side's CPU per streamed token on a 2-vCPU host (~20 µs): above it, the
# HTTP side needs under a tenth of what the core does and stepping back cannot buy much.
STEP_BACK_BELOW_SECONDS_PER_SEQUENCE = 200e-6
SEQUENCE_STEPS_TO_DECIDE = 1024  # of busy steps, before auto decides (a step of 8: 8)
DECIDE_POLL_SECONDS = 0.5


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


def resolve_nice(setting: int | None, api_server_count: int, cpus: int,
                 seconds_per_sequence: float | None = None) -> int:
    """The niceness increment for the HTTP threads: `setting`, or for auto (None) MAX_NICE
    where the host has a CPU for the core besides one per HTTP process and the core's steps
    cost under STEP_BACK_BELOW_SECONDS_PER_SEQUENCE per sequence, else 0 (also while that
    cost is not known yet)."""
    if setting is not None:
        return setting
    if cpus <= api_server_count or seconds_per_sequence is None:
        return 0
    return MAX_NICE if seconds_per_sequence < STEP_BACK_BELOW_SECONDS_PER_SEQUENCE else 0


def step_back(increment: int, task_dir: Path = Path("/proc/self/task")) -> int:
    """Raise the niceness of every thread of this process by `increment` (capped at
    MAX_NICE); returns how many threads it found. Where threads cannot be listed (not Linux),
    it logs why and sets none."""
    if increment <= 0:
        return 0
    seen: set[int] = set()
    for _ in range(10):  # again for threads started by a thread not yet set
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


def step_back_for_core(setting: int | None, api_server_count: int,
                       gauges: Callable[[], Gauges], busy_step_sequences: int) -> None:
    """Lower this HTTP process's threads below its engine core process (`setting`: the
    option.api_server_nice value, None for auto), and log what was done. Auto with a CPU to
    spare decides on a thread of its own once the core (`gauges`) has run
    SEQUENCE_STEPS_TO_DECIDE sequence-steps in busy steps (none run: it never decides)."""
    cpus = usable_cpus()
    if setting is not None or cpus <= api_server_count:
        _step_back_and_log(resolve_nice(setting, api_server_count, cpus), setting,
                           api_server_count, cpus)
        return
    logger.info("HTTP threads keep their CPU priority until the engine core has run %d "
                "sequence-steps in steps of %d sequences or more (option.api_server_nice=auto: "
                "+%d where those cost under %.0f µs per sequence)", SEQUENCE_STEPS_TO_DECIDE,
                busy_step_sequences, MAX_NICE,
                STEP_BACK_BELOW_SECONDS_PER_SEQUENCE * 1e6)
    threading.Thread(target=_decide_when_measured, args=(gauges, api_server_count, cpus),
                     name="cpu-priority", daemon=True).start()


def _decide_when_measured(gauges: Callable[[], Gauges], api_server_count: int, cpus: int,
                          poll_seconds: float = DECIDE_POLL_SECONDS) -> None:
    while (now := gauges()).busy_sequence_steps < SEQUENCE_STEPS_TO_DECIDE:
        if not now.alive:  # the engine stopped first: nothing to step back for
            return
        time.sleep(poll_seconds)
    per_sequence = now.busy_step_seconds / now.busy_sequence_steps
    _step_back_and_log(resolve_nice(None, api_server_count, cpus, per_sequence), None,
                       api_server_count, cpus, per_sequence)


def _step_back_and_log(increment: int, setting: int | None, api_server_count: int, cpus: int,
                       per_sequence: float | None = None) -> None:
    threads = step_back(increment)
    how = "auto" if setting is None else str(setting)
    cost = ("" if per_sequence is None else
            f", the core's busy steps {per_sequence * 1e6:.0f} µs per sequence")
    if threads:
        logger.info("HTTP threads at niceness +%d (%d threads; option.api_server_nice=%s, %d "
                    "usable CPUs%s): the engine core process gets a CPU first", increment,
                    threads, how, cpus, cost)
    else:
        logger.info("HTTP threads keep their CPU priority (option.api_server_nice=%s, %d usable "
                    "CPUs for %d HTTP process(es) and the engine core%s)", how, cpus,
                    api_server_count, cost)
