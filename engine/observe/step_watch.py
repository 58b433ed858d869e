"""StepWatch: a warning that names what made an engine step slow.

A step far slower than the steps before it stalls every running stream at once: the H100 and
H200 sweeps saw 0.3-0.7 s pauses of every stream when a burst of requests arrived. What can
take that long runs on the engine thread, or holds the GIL that thread needs, and leaves no
trace of its own: a full garbage collection, torch.compile of a shape not compiled at
start-up (what those pauses most likely were, found by this watch in a CPU rehearsal:
engine/runner/attention_check.py's pytree_types), a long wait on the device. The watch times the
step's phases (a clock read per mark), the full collections of any thread (a gc callback)
and torch.compile runs (dynamo's compile callbacks), and logs one warning per slow step
naming them, with where the engine thread was once the step had run `slow_seconds` (a
sampler thread that wakes every SAMPLE_SECONDS).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import TYPE_CHECKING

from engine.observe.phases import PhaseMarks
from engine.outputs import StepStats

if TYPE_CHECKING:
    from torch._dynamo.callback import CompilationCallbackHandler

logger = logging.getLogger(__name__)

SLOW_SECONDS = 0.1  # a step is slow past this
SLOW_FACTOR = 10.0  # and past this many times the usual step (a moving average)
USUAL_WEIGHT = 1 / 64  # of each new step in that average
WARN_FIRST = 20  # slow steps each warned about; after them every warn_every-th
SAMPLE_SECONDS = 0.05  # how often the sampler looks for a step running past slow_seconds
STACK_FRAMES = 6  # innermost frames of the engine thread quoted


class StepWatch:
    """start() before a step and finish(stats) after it; install() hooks gc and dynamo."""

    def __init__(self, slow_seconds: float = SLOW_SECONDS, slow_factor: float = SLOW_FACTOR,
                 warn_every: int = 100) -> None:
        self.slow_seconds = slow_seconds
        self.slow_factor = slow_factor
        self.warn_every = warn_every
        self.phases = PhaseMarks()  # the engine's phase clock (LLMEngine.measure_phases)
        self.num_slow = 0
        self.usual_seconds: float | None = None
        self._gc_started: float | None = None
        self._gc_seconds, self._gc_runs = 0.0, 0
        self._compile_started: float | None = None
        self._compile_seconds, self._compile_runs = 0.0, 0
        self._dynamo: CompilationCallbackHandler | None = None
        self._step = 0  # steps started; the sampler tags its stack with one
        self._step_started: float | None = None
        self._stack: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def install(self) -> None:
        """Call on the thread that steps: the sampler watches that thread."""
        gc.callbacks.append(self._on_gc)
        self._stop.clear()
        self._sampler = threading.Thread(target=self._sample, args=(threading.get_ident(),),
                                         name="step-watch", daemon=True)
        self._sampler.start()
        if "torch._dynamo" not in sys.modules:  # nothing compiles (no FlexAttention): not
            return  # worth the second of importing dynamo
        try:  # torch's own hooks (private, present since 2.4); without them compiles go unseen
            from torch._dynamo.callback import callback_handler
        except ImportError:
            return
        callback_handler.register_start_callback(self._on_compile_start)
        callback_handler.register_end_callback(self._on_compile_end)
        self._dynamo = callback_handler

    def uninstall(self) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._dynamo is not None:
            self._dynamo.remove_start_callback(self._on_compile_start)
            self._dynamo.remove_end_callback(self._on_compile_end)
            self._dynamo = None

    def start(self) -> None:
        self._gc_seconds, self._gc_runs = 0.0, 0
        self._compile_seconds, self._compile_runs = 0.0, 0
        self._step += 1
        self._step_started = time.perf_counter()

    def finish(self, stats: StepStats) -> bool:
        """Whether the step was slow (then warned about, within the warning budget)."""
        self._step_started = None
        seconds, usual = stats.step_seconds, self.usual_seconds
        if seconds <= max(self.slow_seconds, self.slow_factor * (usual or 0.0)):
            self.usual_seconds = seconds if usual is None else usual + (seconds - usual) * \
                USUAL_WEIGHT
            return False
        self.num_slow += 1
        if self.num_slow <= WARN_FIRST or self.num_slow % self.warn_every == 0:
            logger.warning("%s", self.describe(stats))
        return True

    def describe(self, stats: StepStats) -> str:
        usual = "" if self.usual_seconds is None else \
            f", the usual step {1000 * self.usual_seconds:.1f} ms"
        phases = ", ".join(f"{name} {1000 * s:.1f}" for name, s in self.phases.seconds.items())
        gcs = (f"{self._gc_runs} ({1000 * self._gc_seconds:.0f} ms)" if self._gc_runs
               else "none")
        compiles = (f"{self._compile_runs} ({self._compile_seconds:.2f} s): a shape not "
                    "compiled at start-up" if self._compile_runs else "none")
        stack = self._stack[1] if self._stack and self._stack[0] == self._step else "not sampled"
        count = "" if self.num_slow <= WARN_FIRST else \
            f" [slow step {self.num_slow}; after the first {WARN_FIRST} every " \
            f"{self.warn_every}th is logged]"
        return (f"slow engine step: {1000 * stats.step_seconds:.0f} ms{usual} "
                f"({stats.num_seqs} sequence{'' if stats.num_seqs == 1 else 's'}: "
                f"{stats.num_prefill_tokens} prompt + "
                f"{stats.num_decode_tokens} decode tokens); phases (ms): {phases or 'none'}; "
                f"full garbage collections: {gcs}; torch.compile runs: {compiles}; engine thread "
                f"at {1000 * self.slow_seconds:.0f} ms: {stack}{count}")

    def _sample(self, thread_id: int) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            started, step = self._step_started, self._step
            if started is None or time.perf_counter() - started < self.slow_seconds:
                continue
            if self._stack is not None and self._stack[0] == step:
                continue  # one sample per step: where it was stuck first
            frame = sys._current_frames().get(thread_id)
            if frame is not None:
                self._stack = step, _innermost(frame)

    def _on_gc(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:  # the young generations take microseconds
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc_seconds += time.perf_counter() - self._gc_started
            self._gc_runs += 1
            self._gc_started = None

    def _on_compile_start(self, *_: object) -> None:
        self._compile_started = time.perf_counter()

    def _on_compile_end(self, *_: object) -> None:
        if self._compile_started is not None:
            self._compile_seconds += time.perf_counter() - self._compile_started
            self._compile_runs += 1
            self._compile_started = None


def _innermost(frame: FrameType) -> str:
    """`file:line function` of the innermost frames, innermost first."""
    frames = traceback.extract_stack(frame)[-STACK_FRAMES:]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                      for f in reversed(frames))
