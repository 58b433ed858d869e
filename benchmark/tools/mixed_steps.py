"""What a prompt costs the step it is prefilled in: pure decode steps against steps that also
prefill K new prompts of P tokens, at a batch of ~B running sequences, offline (no HTTP), with
the engine's phase split.

    python -m benchmark.tools.mixed_steps [P [K [B]]]

MODEL (default /tmp/tiny320) in the environment picks another model. Written for the core-pipes
run (docs/benchmark/cpu-2026-11-27-core-pipes/, "A prompt's cost in the step that prefills it").
It reads the engine's phase clock, an engine internal, so it follows its module path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from benchmark.peer_engine import build_engine
from engine import SamplingParams
from engine.observe.phases import StepPhases

MODEL = Path(os.environ.get("MODEL", "/tmp/tiny320"))
PROPERTIES = Path("docs/benchmark/cpu-2026-11-26-direct-streams/paged.properties")
STEPS, WARM_UP = 6000, 500


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.mixed_steps",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("P", nargs="?", type=int, default=24, help="prompt tokens (default 24)")
    parser.add_argument("K", nargs="?", type=int, default=1,
                        help="prompts prefilled per mixed step (default 1)")
    parser.add_argument("B", nargs="?", type=int, default=27,
                        help="running sequences (default 27)")
    args = parser.parse_args()
    prompt_len, per_step, batch = args.P, args.K, args.B
    engine, _ = build_engine(PROPERTIES, MODEL, "float32", None)
    phases = StepPhases()
    engine.measure_phases(phases)
    params = SamplingParams(max_new_tokens=64, min_new_tokens=64, ignore_eos=True)
    times: dict[str, list[float]] = {"decode": [], "mixed": []}
    split: dict[str, dict[str, float]] = {"decode": {}, "mixed": {}}
    added = 0
    for i in range(STEPS):
        queued = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        if queued + per_step <= batch and i % (2 * per_step) == 0:
            for _ in range(per_step):
                added += 1
                engine.add_request(f"r{added}", list(range(5, 5 + prompt_len)), params)
        start = time.perf_counter()
        engine.step_outputs()
        seconds = time.perf_counter() - start
        step = engine.last_batch
        if step is None or i < WARM_UP:
            continue
        kind = "decode" if not step.num_prefill_tokens else (
            "mixed" if step.num_prefill_tokens == prompt_len * per_step else None)
        if kind is None:
            continue
        times[kind].append(seconds)
        for phase, s in phases.seconds.items():
            split[kind][phase] = split[kind].get(phase, 0.0) + s
    for kind, seen in times.items():
        phase_us = {p: round(s / len(seen) * 1e6, 1) for p, s in split[kind].items()}
        print(f"{kind}: {len(seen)} steps, median {statistics.median(seen) * 1e6:.0f} us; "
              f"mean per phase (us) {phase_us}")


if __name__ == "__main__":
    main()
