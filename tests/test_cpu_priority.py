"""The HTTP process's threads step back for the engine core process (handler/cpu_priority.py):
how many CPUs count as usable (affinity, a container's CPU quota), when auto steps back (a CPU
to spare, the core's steps as cheap as the HTTP work, measured while serving), and that every
thread, including those started later, takes the niceness while a process started before
keeps its own."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.outputs import Gauges
from handler import cpu_priority
from handler.cpu_priority import (
    MAX_NICE,
    SEQUENCE_STEPS_TO_DECIDE,
    resolve_nice,
    step_back,
    usable_cpus,
)

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("files", "expected"), [
    ({}, AFFINITY),  # no cgroup files: the affinity mask
    ({"cpu.max": "max 100000\n"}, AFFINITY),  # v2, no quota
    ({"cpu.max": "50000 100000\n"}, 1),  # v2, half a CPU rounds up to one
    ({"cpu.max": "100000 100000\n"}, 1),
    ({"cpu.max": "6400000 100000\n"}, AFFINITY),  # a quota above the mask: the mask
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, AFFINITY),  # v1
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ({"cpu.max": "garbage\n"}, AFFINITY),
])
def test_usable_cpus_is_the_affinity_mask_capped_by_a_cgroup_quota(tmp_path, files,
                                                                    expected) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert usable_cpus(tmp_path) == expected


@pytest.mark.parametrize(("setting", "servers", "cpus", "per_sequence", "expected"), [
    (None, 1, 1, 20e-6, 0),  # one CPU: the HTTP side would starve, the core wait for input
    (None, 1, 2, None, 0),  # the core's steps not measured yet
    (None, 1, 2, 20e-6, MAX_NICE),  # the tests' 2-layer model: +31-51 % req/s
    (None, 1, 2, 1.25e-3, 0),  # SmolLM2-135M: nothing to gain, inter-token p99 +45 %
    (None, 2, 2, 20e-6, 0),  # two HTTP processes and the core on two CPUs
    (None, 2, 3, 20e-6, MAX_NICE),
    (0, 1, 16, 20e-6, 0),  # off
    (7, 1, 1, None, 7),  # what the user chose, whatever the host and the model
])
def test_auto_steps_back_with_a_cpu_to_spare_and_steps_as_cheap_as_the_http_work(
        setting, servers, cpus, per_sequence, expected) -> None:
    assert resolve_nice(setting, servers, cpus, per_sequence) == expected


def _gauges(sequence_steps: int, step_seconds: float, alive: bool = True) -> Gauges:
    return Gauges(alive, 0, 0, 0, 0, 8, 16, 4, 0.0, step_seconds, sequence_steps)


@pytest.mark.parametrize(("seconds", "expected", "logged"), [
    (0.02, MAX_NICE, "HTTP threads at niceness +19"),  # 20 µs per sequence
    (1.3, 0, "HTTP threads keep their CPU priority"),  # 1,270 µs
])
def test_auto_decides_once_the_core_has_run_enough_steps(monkeypatch, caplog, seconds,
                                                          expected, logged) -> None:
    """Nothing is decided until busy steps of SEQUENCE_STEPS_TO_DECIDE sequence-steps are
    measured; then their cost decides, once, and the log says it with the figure."""
    taken: list[int] = []
    monkeypatch.setattr(cpu_priority, "step_back",
                        lambda increment: taken.append(increment) or 9 * (increment > 0))
    seen = iter([_gauges(0, 0.0), _gauges(512, seconds / 2), _gauges(1024, seconds),
                 _gauges(2048, 99.0)])
    with caplog.at_level(logging.INFO):
        cpu_priority._decide_when_measured(lambda: next(seen), 1, 2, poll_seconds=0)
    assert taken == [expected]
    assert next(seen).busy_sequence_steps == 2048  # it stopped looking once decided
    per_sequence = round(seconds / SEQUENCE_STEPS_TO_DECIDE * 1e6)
    assert logged in caplog.text and f"{per_sequence} µs per sequence" in caplog.text


def test_auto_leaves_the_priority_alone_when_the_engine_stops_first(monkeypatch) -> None:
    taken: list[int] = []
    monkeypatch.setattr(cpu_priority, "step_back",
                        lambda increment: taken.append(increment) or 9 * (increment > 0))
    seen = iter([_gauges(10, 0.001), _gauges(10, 0.001, alive=False)])
    cpu_priority._decide_when_measured(lambda: next(seen), 1, 2, poll_seconds=0)
    assert taken == []


SCRIPT = """
import os, subprocess, sys, threading, time
from handler.cpu_priority import step_back

def nice(tid=None): return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())
base = nice()
before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
go, found = threading.Event(), {}
def started_before():
    go.wait()
    inner = threading.Thread(target=lambda: found.update(grandchild=nice()))
    inner.start(); inner.join()
    found["before"] = nice()
old = threading.Thread(target=started_before); old.start()
time.sleep(0.1)
count = step_back(int(sys.argv[1]))
late = threading.Thread(target=lambda: found.update(after=nice()))
late.start(); late.join()
go.set(); old.join()
found.update(main=nice(), process_before=os.getpriority(
    os.PRIO_PROCESS, before.pid), count=count, base=base)
before.kill()
print(found)
"""


def test_every_thread_steps_back_and_a_process_started_before_keeps_its_priority() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, "3"], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent, timeout=60)
    found = ast.literal_eval(out.stdout)
    want = min(MAX_NICE, found["base"] + 3)
    assert found["count"] >= 2  # the main thread and the one already started
    assert [found[k] for k in ("main", "before", "grandchild", "after")] == [want] * 4
    assert found["process_before"] == found["base"]  # the engine core's case


def test_without_a_thread_list_nothing_changes_and_the_log_says_why(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        assert step_back(5, tmp_path / "no-such-dir") == 0
    assert "keep their CPU priority" in caplog.text
    assert step_back(0) == 0  # off: not even listed
