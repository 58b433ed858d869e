"""Step anatomy: where one engine step's time goes, per step kind (prefill; decode at batch
1, 8, 32, ...), on any model and device. The instrument for making the decode step GPU-grade.

Each batch size gets its own requests: the prefill steps that admit them, then decode steps
measured twice. Once with a phase clock that (on CUDA) synchronizes at every phase boundary, so
each phase owns its device work: that gives the split. Once without, as served: that gives the
step time, and on CUDA the device-busy time per step (torch.profiler's kernel time), whose
ratio to the step is how host-bound the step is. Then "mixed" steps: one new prompt admitted
beside the batch's decodes, the step continuous and paged batching take at every arrival
(on CUDA their device-busy time too, from a second pass).
Each row says what share of its steps replayed a CUDA graph; with `prompt_tokens` (a synthetic
prompt of that length) and `enforce_eager`, graphs and eager steps compare at long contexts.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from benchmark.device_time import device_busy, device_sync
from benchmark.workloads import LMI_WORKLOAD, Lengths, synthetic_jobs
from engine.observe.phases import PHASES, NoPhases, StepPhases


class MeasuredStep(NamedTuple):
    tokens: int  # computed by the step
    seconds: dict[str, float]  # per phase
    graph: bool  # whether it replayed a CUDA graph


@dataclass(frozen=True)
class StepProfile:
    kind: str  # "prefill", "decode" or "mixed" (one new prompt beside the running decodes)
    batch: int  # sequences in the step
    tokens: int  # tokens computed by the step
    steps: int  # steps measured
    step_ms: float  # median wall time of a step, as served (no syncs but the step's own)
    phases_ms: dict[str, float]  # median per phase, with syncs at phase boundaries
    device_busy_ms: float | None  # kernel time per step (CUDA only)
    # the kernels taking most device time: name, µs and launches per step (CUDA only)
    top_kernels: tuple[tuple[str, float, float], ...] = ()
    graph_share: float = 0.0  # of the phase-split steps, those that replayed a CUDA graph

    @property
    def host_us_per_seq(self) -> float:
        """Host phases (everything but forward) per sequence: the cost batching must hide."""
        host = sum(ms for phase, ms in self.phases_ms.items() if phase != "forward")
        return 1000 * host / self.batch

    @property
    def core_us_per_seq(self) -> float:
        """The engine core's share of host_us_per_seq: served, detokenization runs in the
        serving process, beside the core."""
        return self.host_us_per_seq - 1000 * self.phases_ms.get("detokenize", 0.0) / self.batch


@dataclass(frozen=True)
class ProfileRun:
    model: str
    device: str
    dtype: str
    strategy: str
    prompt_tokens: int
    rows: list[StepProfile]
    tensor_parallel: int = 1
    async_scheduling: bool = False
    enforce_eager: bool = False

    def table(self) -> str:
        head = ["step", "batch", "tokens", "step ms", *(f"{p} ms" for p in PHASES),
                "host us/seq", "core us/seq", "device busy ms", "graphs"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            busy = "-" if r.device_busy_ms is None else f"{r.device_busy_ms:.3f}"
            cells = [r.kind, str(r.batch), str(r.tokens), f"{r.step_ms:.3f}",
                     *(f"{r.phases_ms.get(p, 0.0):.3f}" for p in PHASES),
                     f"{r.host_us_per_seq:.1f}", f"{r.core_us_per_seq:.1f}", busy,
                     f"{100 * r.graph_share:.0f}%"]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        data = {**asdict(self), "rows": [{**asdict(r), "host_us_per_seq": r.host_us_per_seq,
                                          "core_us_per_seq": r.core_us_per_seq}
                                         for r in self.rows]}
        (out_dir / "profile.json").write_text(json.dumps(data, indent=2))
        (out_dir / "profile.md").write_text(
            f"Step anatomy: {self.model} on {self.device} ({self.dtype}), strategy "
            f"{self.strategy}, {self.prompt_tokens}-token prompts, tensor parallel "
            f"{self.tensor_parallel}, asynchronous scheduling "
            f"{'on' if self.async_scheduling else 'off'}"
            f"{', every step eager' if self.enforce_eager else ''}; medians.\n\n"
            + self.table() + "\n" + self.kernels())

    def kernels(self) -> str:
        """The largest decode and mixed batches' top kernels (CUDA only), as lists."""
        text = ""
        for kind in ("decode", "mixed"):
            rows = [r for r in self.rows if r.kind == kind and r.top_kernels]
            if rows:
                row = max(rows, key=lambda r: r.batch)
                lines = [f"- {us:.1f} µs, {calls:g} launches: `{name}`"
                         for name, us, calls in row.top_kernels]
                text += (f"\nKernels of a {kind} step at batch {row.batch}, per step:\n\n"
                         + "\n".join(lines) + "\n")
        return text


def run_profile(model_dir: Path, batch_sizes: list[int], steps: int = 20, warmup: int = 3,
                strategy: str = "paged", dtype: str = "auto", device: str = "auto",
                prompt: str = LMI_WORKLOAD[1].prompt, tensor_parallel: int = 1,
                async_scheduling: bool | None = None, prompt_tokens: int | None = None,
                enforce_eager: bool = False) -> ProfileRun:
    """Profile prefill and decode steps at each batch size on one engine; `prompt_tokens`
    replaces `prompt` with random words of that many tokens."""
    from transformers import AutoTokenizer

    from engine import EngineConfig, LLMEngine

    # decode steps: both passes, the profiler's, the mixed steps' two passes
    new_tokens = warmup + 5 * steps + 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if prompt_tokens is not None:
        prompt = synthetic_jobs(1, Lengths("fixed", prompt_tokens), Lengths("fixed", 1),
                                tokenizer=tokenizer)[0].prompt
    prompt_ids = tokenizer.encode(prompt)
    # Whole blocks per sequence, so the pool (max_num_seqs x max_model_len tokens) holds
    # every sequence at once: no preemption distorts the figures.
    block_size = 16
    max_model_len = -(-(len(prompt_ids) + new_tokens + 1) // block_size) * block_size
    config = EngineConfig(model=str(model_dir), batching=strategy, dtype=dtype, device=device,
                          max_num_seqs=max(batch_sizes) + 1, max_model_len=max_model_len,
                          block_size=block_size, tensor_parallel_size=tensor_parallel,
                          async_scheduling=async_scheduling, enforce_eager=enforce_eager)
    engine = LLMEngine.from_config(config)
    engine.guided.wait_built()  # its background build would slow the first steps measured
    rows: list[StepProfile] = []
    try:
        for batch in batch_sizes:
            rows += _profile_batch(engine, prompt_ids, batch, new_tokens, steps, warmup)
    finally:
        engine.close()
    return ProfileRun(str(model_dir), str(engine.runner.device),
                      str(engine.runner.kv_cache.dtype).removeprefix("torch."), strategy,
                      len(prompt_ids), rows, tensor_parallel, engine.async_scheduling,
                      enforce_eager)


def _profile_batch(engine, prompt_ids: list[int], batch: int, new_tokens: int, steps: int,
                   warmup: int) -> list[StepProfile]:
    from engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, prompt_ids, params)
    sync = device_sync(engine.runner.device)
    prefill = _phase_steps(engine, sync, is_prefill=True)
    for _ in range(warmup):
        engine.step()
    decode = _phase_steps(engine, sync, is_prefill=False, count=steps)
    step_ms = _served_step_ms(engine, sync, steps)
    decode_busy = mixed_busy = (None, ())
    if sync is not None:
        decode_busy = device_busy(lambda: [engine.step() for _ in range(steps)], steps)
    mixed = _mixed_steps(engine, prompt_ids, params, sync, steps)
    if sync is not None:  # a second pass: the profiler's callbacks would slow the one timed
        mixed_busy = device_busy(lambda: _mixed_steps(engine, prompt_ids, params, None, steps),
                                 steps)
    for request_id in ids:
        engine.abort(request_id)
    return [_row("prefill", batch, prefill, None),
            _row("decode", batch, decode, step_ms, *decode_busy),
            _row("mixed", batch + 1, mixed, None, *mixed_busy)]


def _mixed_steps(engine, prompt_ids: list[int], params, sync: Callable[[], None] | None,
                 count: int) -> list[MeasuredStep]:
    """The step continuous and paged batching take at each arrival: one new prompt beside the
    running decodes, `count` times (each new request is aborted after its step)."""
    measured = []
    with _measuring(engine, sync) as phases:
        for i in range(count):
            engine.add_request(f"mixed-{i}", prompt_ids, params)
            engine.step()
            batch = engine.last_batch
            # all of the prompt, or under paged batching the chunk of it that fills the step's
            # token budget
            budget = getattr(engine.scheduler, "max_num_batched_tokens", None)
            assert batch is not None and (
                batch.num_prefill_tokens == len(prompt_ids)
                or batch.num_prefill_tokens + batch.num_decode_tokens == budget), \
                "the new prompt was not admitted beside the decodes"
            measured.append(_measured(engine, phases))
            engine.abort(f"mixed-{i}")
    return measured


@contextmanager
def _measuring(engine, sync: Callable[[], None] | None) -> Iterator[StepPhases]:
    """The engine's phase clock for the block's steps (read .seconds after each)."""
    phases = StepPhases(sync)
    engine.measure_phases(phases)
    try:
        yield phases
    finally:
        engine.measure_phases(NoPhases())


def _phase_steps(engine, sync: Callable[[], None] | None, *, is_prefill: bool,
                 count: int | None = None) -> list[MeasuredStep]:
    """Each step of the kind asked for, up to `count`; the first step of the other kind ends
    it (and is not recorded)."""
    measured = []
    with _measuring(engine, sync) as phases:
        while count is None or len(measured) < count:
            engine.step()
            batch = engine.last_batch
            if batch is None:  # nothing could run yet (never under continuous or paged)
                continue
            if (batch.num_prefill_tokens > 0) != is_prefill:
                break
            measured.append(_measured(engine, phases))
    return measured


def _measured(engine, phases: StepPhases) -> MeasuredStep:
    """The engine's latest step as its phase clock and model runner saw it."""
    batch = engine.last_batch
    return MeasuredStep(batch.num_prefill_tokens + batch.num_decode_tokens, dict(phases.seconds),
                        engine.runner.last_step_graph)


def _served_step_ms(engine, sync: Callable[[], None] | None, steps: int) -> float:
    """Median step time as served: no sync between steps (a step waits only for what it
    reads, so planning ahead overlaps the device's work, as in the server)."""
    times = []
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
        now = time.perf_counter()
        times.append(now - start)
        start = now
    if sync is not None:
        sync()
    return 1000 * statistics.median(times)


def _row(kind: str, batch: int, measured: list[MeasuredStep], step_ms: float | None,
         busy_ms: float | None = None,
         kernels: tuple[tuple[str, float, float], ...] = ()) -> StepProfile:
    phases_ms = {p: 1000 * statistics.median(m.seconds.get(p, 0.0) for m in measured)
                 for p in PHASES}
    wall = step_ms if step_ms is not None else sum(phases_ms.values())
    graphs = statistics.fmean(m.graph for m in measured)
    return StepProfile(kind, batch, int(statistics.median(m.tokens for m in measured)),
                       len(measured), wall, phases_ms, busy_ms, kernels, graphs)
