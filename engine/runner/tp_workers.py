"""Rank 0's handle on tensor-parallel ranks 1..N-1: their processes and the pipes that carry each
step's plan to them.

Rank 0 owns the scheduler; a worker rank only runs the model on the plan it reads from its stdin
(engine/core/tp_worker.py). A plan travels as one pickle per step over a pipe, not as a
collective, so an idle worker waits without a timeout, and the end of rank 0 (its pipe closing)
ends the workers. The model's own collectives (engine/parallel/comm.py) time out instead.

At start-up each worker also reports, over a pipe of its own, when it joins the ranks and when its
shard is loaded; rank 0 waits for those reports (watching the processes) before the rendezvous and
before the first collective, so that a worker that dies while it starts or loads fails the start
at once, rather than leaving rank 0 in a rendezvous or collective that waits for it up to
STARTUP_TIMEOUT.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.runner.step_plan import StepPlan

logger = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A tensor-parallel rank died, hung or fell out of step: the engine cannot go on."""


@dataclass(frozen=True)
class WorkerArgs:
    """The first message on a worker's stdin."""

    config: EngineConfig
    rank: int
    size: int
    store_path: str  # the file store through which the ranks find each other
    log_level: int
    status_fd: int  # the worker's end of its start-up report pipe (report_stage)


def report_stage(fd: int, stage: str) -> None:
    """A worker's start-up report to rank 0 (WorkerGroup.wait_for)."""
    os.write(fd, f"{stage}\n".encode())


class WorkerGroup:
    """Starts ranks 1..size-1 (they load their shards meanwhile); send() hands each one a plan."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        self.size = size
        self._store_dir = tempfile.mkdtemp(prefix="batchyard-tp-")
        self.store_path = str(Path(self._store_dir) / "store")
        self._procs: list[subprocess.Popen] = []
        self._status: list[int] = []  # rank 0's end of each worker's report pipe
        self._reports: dict[int, list[str]] = {}  # reports read ahead, by pipe
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, size):
            status, their_end = os.pipe()
            self._status.append(status)
            try:
                proc = subprocess.Popen([sys.executable, "-m", "engine.core.tp_worker"],
                                        stdin=subprocess.PIPE, pass_fds=(their_end,))
            finally:
                os.close(their_end)  # theirs alone: its EOF then says the worker is gone
            self._procs.append(proc)
            self._write(proc, WorkerArgs(config, rank, size, self.store_path, level, their_end))
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._status,
                                           self._store_dir, 10.0)
        logger.info("tensor parallel: started %d worker ranks (pids %s)", size - 1,
                    [p.pid for p in self._procs])

    def send(self, plan: StepPlan | None) -> None:
        """The step's plan to every worker (None: stop); WorkerLost if one is gone."""
        self.check()
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, proc in enumerate(self._procs, start=1):
            assert proc.stdin is not None  # stdin=PIPE
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except OSError as err:
                raise WorkerLost(f"tensor-parallel rank {rank} is gone ({err})") from err

    def wait_for(self, stage: str, timeout: float) -> None:
        """Until every worker has reported `stage` (report_stage); WorkerLost at once if one
        exits first, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        waiting = dict(zip(self._status, range(1, self.size), strict=True))  # fd -> rank
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerLost(f"tensor-parallel ranks {sorted(waiting.values())} did not "
                                 f"report {stage!r} within {timeout:g} s")
            ready = [fd for fd in waiting if self._reports.get(fd)]  # read ahead already
            if not ready:
                ready = _readable(list(waiting), min(left, 1.0))
            for fd in ready:
                line = self._read_report(fd)
                if line != stage:  # EOF: the worker is exiting; check() says how, once it has
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._procs[waiting[fd] - 1].wait(5.0)
                    self.check()
                    raise WorkerLost(f"tensor-parallel rank {waiting[fd]} reported {line!r} "
                                     f"instead of {stage!r}")
                del waiting[fd]
            self.check()  # a worker may be gone while another one's pipe stays open

    def _read_report(self, fd: int) -> str:
        """The next report line from `fd` ('' at EOF); a report is one short write, so it
        arrives whole, and a read that brings two keeps the second for the next stage."""
        lines = self._reports.setdefault(fd, [])
        if not lines:
            lines += os.read(fd, 256).decode(errors="replace").split()
        return lines.pop(0) if lines else ""

    def check(self) -> None:
        """WorkerLost if a worker rank has exited."""
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                raise WorkerLost(f"tensor-parallel rank {rank} exited with code {code} (its "
                                 f"log says why)")

    def kill(self) -> None:
        """End every worker now (rank 0 failed mid-step: their collectives would hang)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the pipes (the workers exit after their current step) and wait for them."""
        self._finalizer.detach()
        _stop(self._procs, self._status, self._store_dir, timeout)

    @staticmethod
    def _write(proc: subprocess.Popen, message: Any) -> None:
        assert proc.stdin is not None  # stdin=PIPE
        pickle.dump(message, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()


def _readable(fds: list[int], timeout: float) -> list[int]:
    """Which of `fds` can be read (a report, or EOF) within `timeout` seconds."""
    poller = select.poll()  # not select.select: an fd past 1024 is fine
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(timeout * 1000)]


def _stop(procs: list[subprocess.Popen], status: list[int], store_dir: str,
          timeout: float) -> None:
    for fd in status:
        try:
            os.close(fd)
        except OSError:
            pass
    status.clear()
    for proc in procs:
        assert proc.stdin is not None  # stdin=PIPE
        try:
            proc.stdin.close()
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
            proc.kill()
            proc.wait()
    shutil.rmtree(store_dir, ignore_errors=True)
