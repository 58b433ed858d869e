"""Where a step's time goes: host time per phase, marked by the engine and the runner.

The engine always holds a phase clock; the default one does nothing. A serving core holds
PhaseMarks (a clock read per mark, for its slow-step reports); `benchmark profile` swaps in
StepPhases."""

from __future__ import annotations

import time
from collections.abc import Callable

# In step order. prepare holds the metadata build and its host->device copies; forward holds
# the model and the logits; sample holds the device->host copy of the sampled ids;
# postprocess holds the scheduler's bookkeeping; detokenize the output processor (text, stop
# strings), which runs on its own thread when serving.
PHASES = ("schedule", "prepare", "forward", "sample", "postprocess", "detokenize")


class NoPhases:
    """The serving default: marks cost nothing and record nothing."""

    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass


class StepPhases:
    """Seconds per phase of the latest step. `sync` (e.g. torch.cuda.synchronize) runs before
    each mark, so device work queued in a phase is counted in it, not in the next one."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._sync = sync
        self._last = 0.0
        self.seconds: dict[str, float] = {}

    def start(self) -> None:
        self.seconds = {}
        self._last = self._now()

    def mark(self, phase: str) -> None:
        now = self._now()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()


class PhaseMarks:
    """The serving clock: one clock read per mark, summed per phase only when asked (a slow
    step's report, engine/observe/step_watch.py), so an ordinary step pays about a microsecond."""

    def __init__(self) -> None:
        self._start = 0.0
        self._marks: list[tuple[str, float]] = []

    def start(self) -> None:
        self._marks.clear()
        self._start = time.perf_counter()

    def mark(self, phase: str) -> None:
        self._marks.append((phase, time.perf_counter()))

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per phase since start(), in the order first marked."""
        seconds: dict[str, float] = {}
        last = self._start
        for phase, now in self._marks:
            seconds[phase] = seconds.get(phase, 0.0) + now - last
            last = now
        return seconds


PhaseClock = NoPhases | StepPhases | PhaseMarks
