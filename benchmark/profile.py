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
The run names the attention backend its steps used (after any start-up fallback).

The hardware floor of a decode or mixed row (issue #51's targets are multiples of it): the
time the step's unavoidable memory traffic takes at the GPU's HBM bandwidth,

    floor_ms = 1000 * (weight_bytes + kv_bytes) / bandwidth
    kv_bytes = sum over sequences and layers of min(context, window) x 2 x kv_heads x head_dim
               x element size   (K and V, as the rank's KV pool holds them)

with `weight_bytes` the model's weights on this rank (parameters, and on the CPU the packed
copies that replace its linears), each counted once: an untied input embedding counts whole
although a step reads only its tokens' rows (~2% of a 7B model: the floor is that much high).
A decode sequence's context is its length at the median step of the timed pass (measured,
not assumed: chunked prefill leaves sequences some steps apart); a mixed row adds the new
prompt's chunk, whose own K/V its attention reads. `floor_ratio` = step_ms / floor_ms. The
bandwidth comes from HBM_BANDWIDTH by the CUDA device's name, or from `hbm_bandwidth`; none on
the CPU or an unknown card (no floor). Prefill rows have none: compute bounds them, not memory.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from benchmark.device_time import device_busy, device_sync
from benchmark.workloads import LMI_WORKLOAD, Lengths, synthetic_jobs
from engine.observe.phases import PHASES, NoPhases, StepPhases

# HBM bandwidth per card, bytes/s (the vendors' figures), by a substring of
# torch.cuda.get_device_name; the longest match wins ("NVIDIA H100 PCIe" is no SXM H100).
HBM_BANDWIDTH = {"H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "H200": 4.8e12}


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
    # K/V positions a step reads, summed over its sequences (before windows; decode, mixed)
    kv_tokens: float | None = None
    floor_ms: float | None = None  # the step's memory traffic at HBM bandwidth (see above)

    @property
    def floor_ratio(self) -> float | None:
        """step_ms over the hardware floor (1.0: at the floor)."""
        return None if not self.floor_ms else self.step_ms / self.floor_ms

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
    attention_backend: str = ""  # the one the steps used
    weight_bytes: int = 0  # this rank's weights, read once per step
    hbm_bytes_per_s: float | None = None  # the floor's bandwidth (None: no floor)

    def table(self) -> str:
        head = ["step", "batch", "tokens", "step ms", *(f"{p} ms" for p in PHASES),
                "host us/seq", "core us/seq", "device busy ms", "floor ms", "floor x",
                "graphs"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            cells = [r.kind, str(r.batch), str(r.tokens), f"{r.step_ms:.3f}",
                     *(f"{r.phases_ms.get(p, 0.0):.3f}" for p in PHASES),
                     f"{r.host_us_per_seq:.1f}", f"{r.core_us_per_seq:.1f}",
                     _cell(r.device_busy_ms, 3), _cell(r.floor_ms, 3), _cell(r.floor_ratio, 2),
                     f"{100 * r.graph_share:.0f}%"]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        data = {**asdict(self), "rows": [{**asdict(r), "host_us_per_seq": r.host_us_per_seq,
                                          "core_us_per_seq": r.core_us_per_seq,
                                          "floor_ratio": r.floor_ratio}
                                         for r in self.rows]}
        (out_dir / "profile.json").write_text(json.dumps(data, indent=2))
        (out_dir / "profile.md").write_text(
            f"Step anatomy: {self.model} on {self.device} ({self.dtype}), strategy "
            f"{self.strategy}, {self.prompt_tokens}-token prompts, tensor parallel "
            f"{self.tensor_parallel}, asynchronous scheduling "
            f"{'on' if self.async_scheduling else 'off'}"
            f"{', every step eager' if self.enforce_eager else ''}, attention "
            f"{self.attention_backend or '?'}, {self._floor_text()}; medians.\n\n"
            + self.table() + "\n" + self.kernels())

    def _floor_text(self) -> str:
        if self.hbm_bytes_per_s is None:
            return "no hardware floor (no HBM bandwidth known)"
        return (f"floor at {self.hbm_bytes_per_s / 1e12:g} TB/s over "
                f"{self.weight_bytes / 2**20:.1f} MiB of weights plus the K/V read")

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
                enforce_eager: bool = False, attention_backend: str = "auto",
                hbm_bandwidth: float | None = None) -> ProfileRun:
    """Profile prefill and decode steps at each batch size on one engine; `prompt_tokens`
    replaces `prompt` with random words of that many tokens; `hbm_bandwidth` (bytes/s) sets
    the floor's bandwidth (default: by the CUDA card's name; none on the CPU)."""
    from transformers import AutoTokenizer

    from engine import EngineConfig, LLMEngine

    # decode steps: both passes, the profiler's, the mixed steps' two passes
    new_tokens = warmup + 5 * steps + 2
    if attention_backend == "triton":
        _import_triton_for(device)
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
                          async_scheduling=async_scheduling, enforce_eager=enforce_eager,
                          attention_backend=attention_backend)
    engine = LLMEngine.from_config(config)
    engine.guided.wait_built()  # its background build would slow the first steps measured
    runner = engine.runner
    weights = weight_bytes(runner.model)
    bandwidth = hbm_bandwidth_of(runner.device, hbm_bandwidth)
    floor = None if bandwidth is None else hardware_floor(runner, weights, bandwidth)
    rows: list[StepProfile] = []
    try:
        for batch in batch_sizes:
            rows += _profile_batch(engine, prompt_ids, batch, new_tokens, steps, warmup, floor)
    finally:
        engine.close()
    return ProfileRun(str(model_dir), str(runner.device),
                      str(runner.kv_cache.dtype).removeprefix("torch."), strategy,
                      len(prompt_ids), rows, tensor_parallel, engine.async_scheduling,
                      enforce_eager, runner.attention.name, weights, bandwidth)


def _import_triton_for(device: str) -> None:
    """Triton fixes at import whether it interprets (the CPU) or compiles: import it for the
    engine's device before the tokenizer's transformers does (compiled, via torch._dynamo)."""
    from engine.kernels.triton_setup import TritonUnavailable, import_triton
    from engine.models.loader import resolve_device

    with contextlib.suppress(TritonUnavailable, ValueError):  # the engine's start says why
        import_triton(resolve_device(device))


@dataclass(frozen=True)
class HardwareFloor:
    """A step's unavoidable HBM traffic, as time: the weights once, each sequence's K/V once."""

    weight_bytes: int
    kv_bytes_per_position: int  # K and V of one position in one layer
    windows: tuple[int | None, ...]  # per layer (None: full attention)
    bytes_per_s: float

    def kv_bytes(self, contexts: Iterable[float]) -> float:
        """K/V a step reads for sequences of these contexts (a windowed layer: its window)."""
        return self.kv_bytes_per_position * sum(
            c if w is None else min(c, w) for c in contexts for w in self.windows)

    def ms(self, contexts: Iterable[float]) -> float:
        return 1000 * (self.weight_bytes + self.kv_bytes(contexts)) / self.bytes_per_s


def hbm_bandwidth_of(device: torch.device, override: float | None = None) -> float | None:
    """Bytes/s: `override`, else HBM_BANDWIDTH's entry for this CUDA card; None (no floor) on
    the CPU or a card not in the table."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    matches = [key for key in HBM_BANDWIDTH if key in name]
    return HBM_BANDWIDTH[max(matches, key=len)] if matches else None


def hardware_floor(runner, weights: int, bytes_per_s: float) -> HardwareFloor:
    """The floor of `runner`'s steps: `weights` bytes, and K/V positions as its rank's KV pool
    holds them ([tensors, 2, slots, kv_heads, head_dim])."""
    pool = runner.kv_cache
    return HardwareFloor(weights, 2 * pool.shape[-2] * pool.shape[-1] * pool.element_size(),
                         tuple(runner.spec.windows), bytes_per_s)


def weight_bytes(model: torch.nn.Module) -> int:
    """What a step reads of the model: its parameters and persistent buffers (int8 weights),
    and the tensors packed CPU linears keep as plain attributes (engine/models/linear.py);
    each tensor once (tied weights share one Parameter)."""
    tensors: dict[int, int] = {}
    for module in model.modules():
        buffers = [b for name, b in module._buffers.items()
                   if name not in module._non_persistent_buffers_set]
        for t in [*module._parameters.values(), *buffers, *vars(module).values()]:
            if isinstance(t, torch.Tensor):
                tensors[id(t)] = t.numel() * t.element_size()
    return sum(tensors.values())


def _profile_batch(engine, prompt_ids: list[int], batch: int, new_tokens: int, steps: int,
                   warmup: int, floor: HardwareFloor | None = None) -> list[StepProfile]:
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
    before = _lengths(engine)
    step_ms = _served_step_ms(engine, sync, steps)
    decode_contexts = _median_step(before, _lengths(engine))  # the step_ms pass's
    decode_busy = mixed_busy = (None, ())
    if sync is not None:
        decode_busy = device_busy(lambda: [engine.step() for _ in range(steps)], steps)
    before = _lengths(engine)
    mixed = _mixed_steps(engine, prompt_ids, params, sync, steps)
    mixed_contexts = _median_step(before, _lengths(engine))  # the decodes beside the prompt
    if sync is not None:  # a second pass: the profiler's callbacks would slow the one timed
        mixed_busy = device_busy(lambda: _mixed_steps(engine, prompt_ids, params, None, steps),
                                 steps)
    for request_id in ids:
        engine.abort(request_id)
    decode_row = _row("decode", batch, decode, step_ms, *decode_busy)
    mixed_row = _row("mixed", batch + 1, mixed, None, *mixed_busy)
    # the new prompt's chunk: the step's tokens but the decodes' one each
    chunk = mixed_row.tokens - len(mixed_contexts)
    return [_row("prefill", batch, prefill, None),
            _with_floor(decode_row, decode_contexts, floor),
            _with_floor(mixed_row, [*mixed_contexts, chunk], floor)]


def _lengths(engine) -> dict[int, int]:
    """Each running sequence's tokens (prompt and generated so far), by sequence id."""
    return {seq.seq_id: seq.num_tokens for seq in engine.scheduler.running}


def _median_step(before: dict[int, int], after: dict[int, int]) -> list[float]:
    """Each sequence's context at the median step of a pass that grew it from `before` to
    `after`: a step reads its sequence's length then (its new token's K/V included), so the
    pass's steps read before .. after - 1. Measured rather than derived from the step count:
    chunked prefill leaves the batch's sequences some tokens apart."""
    return [(before[seq] + after[seq] - 1) / 2 for seq in before if seq in after]


def _with_floor(row: StepProfile, contexts: list[float],
                floor: HardwareFloor | None) -> StepProfile:
    return replace(row, kv_tokens=sum(contexts),
                   floor_ms=None if floor is None else floor.ms(contexts))


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


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(kind: str, batch: int, measured: list[MeasuredStep], step_ms: float | None,
         busy_ms: float | None = None,
         kernels: tuple[tuple[str, float, float], ...] = ()) -> StepProfile:
    phases_ms = {p: 1000 * statistics.median(m.seconds.get(p, 0.0) for m in measured)
                 for p in PHASES}
    wall = step_ms if step_ms is not None else sum(phases_ms.values())
    graphs = statistics.fmean(m.graph for m in measured)
    return StepProfile(kind, batch, int(statistics.median(m.tokens for m in measured)),
                       len(measured), wall, phases_ms, busy_ms, kernels, graphs)
