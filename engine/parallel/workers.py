"""Rank 0's handle on tensor-parallel ranks 1..N-1: their processes and the pipes that carry each
step's plan to them.

Rank 0 owns the scheduler; a worker rank only runs the model on the plan it reads from its stdin
(engine/parallel/worker.py). A plan travels as one pickle per step over a pipe, not as a
collective, so an idle worker waits without a timeout, and the end of rank 0 (its pipe closing)
ends the workers. The model's own collectives (engine/parallel/comm.py) time out instead.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.step_plan import StepPlan

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


class WorkerGroup:
    """Starts ranks 1..size-1 (they load their shards meanwhile); send() hands each one a plan."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        self.size = size
        self._store_dir = tempfile.mkdtemp(prefix="batchyard-tp-")
        self.store_path = str(Path(self._store_dir) / "store")
        self._procs: list[subprocess.Popen] = []
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", "engine.parallel.worker"],
                                    stdin=subprocess.PIPE)
            self._procs.append(proc)
            self._write(proc, WorkerArgs(config, rank, size, self.store_path, level))
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._store_dir, 10.0)
        logger.info("tensor parallel: started %d worker ranks (pids %s)", size - 1,
                    [p.pid for p in self._procs])

    def send(self, plan: StepPlan | None) -> None:
        """The step's plan to every worker (None: stop); WorkerLost if one is gone."""
        self.check()
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, proc in enumerate(self._procs, start=1):
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except OSError as err:
                raise WorkerLost(f"tensor-parallel rank {rank} is gone ({err})") from err

    def check(self) -> None:
        """WorkerLost if a worker rank has exited."""
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                raise WorkerLost(f"tensor-parallel rank {rank} exited with code {code}")

    def kill(self) -> None:
        """End every worker now (rank 0 failed mid-step: their collectives would hang)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the pipes (the workers exit after their current step) and wait for them."""
        self._finalizer.detach()
        _stop(self._procs, self._store_dir, timeout)

    @staticmethod
    def _write(proc: subprocess.Popen, message: Any) -> None:
        pickle.dump(message, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()


def _stop(procs: list[subprocess.Popen], store_dir: str, timeout: float) -> None:
    for proc in procs:
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
