"""The HTTP process's threads step back for the engine core process (handler/cpu_priority.py):
how many CPUs count as usable (affinity, a container's CPU quota), when auto steps back, and
that every thread, including those started later, takes the niceness while a process started
before keeps its own."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from handler.cpu_priority import MAX_NICE, resolve_nice, step_back, usable_cpus

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


@pytest.mark.parametrize(("setting", "servers", "cpus", "expected"), [
    (None, 1, 1, 0),  # one CPU: the HTTP side would starve, and the core wait for its input
    (None, 1, 2, MAX_NICE),
    (None, 2, 2, 0),  # two HTTP processes and the core on two CPUs
    (None, 2, 3, MAX_NICE),
    (0, 1, 16, 0),  # off
    (7, 1, 1, 7),  # what the user chose, whatever the host
])
def test_auto_steps_back_only_with_a_cpu_for_the_core_besides_the_http_processes(
        setting, servers, cpus, expected) -> None:
    assert resolve_nice(setting, servers, cpus) == expected


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
