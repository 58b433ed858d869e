"""LLMEngine: tokenizer, scheduler and model runner; one step is schedule → run → postprocess."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.config import EngineConfig
from engine.guided import GuidedDecoding
from engine.inputs import GenerationRequest, RequestLimits
from engine.kv.budget import max_concurrency
from engine.lora.errors import UnknownAdapter
from engine.observe.async_check import choose_async_scheduling
from engine.observe.phases import NoPhases, PhaseClock
from engine.outputs import Gauges, SampledToken, StepStats, TokenEvent
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, build_scheduler
from engine.sequence import FinishReason, Sequence
from engine.spec.speculator import Speculator
from engine.text.output_processor import OutputProcessor, StepOutput
from engine.text.tokenizer_files import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.lora.manager import AdapterRegistry
    from engine.runner.model_runner import ModelRunner, StepResult

logger = logging.getLogger(__name__)


class RemoteKV(Protocol):
    """K/V of a sequence's leading tokens that another worker computes (engine/disagg/)."""

    def place(self, runner: ModelRunner, seq: Sequence, start: int) -> None:
        """Put it in `seq`'s blocks from position `start` on, before its step runs."""


@dataclass
class _Request:
    request_id: str
    seq: Sequence


@dataclass(frozen=True)
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    batch: ScheduledBatch
    result: StepResult
    # a sequence it samples cannot be planned before its token is known (grammar, penalties)
    blocks_planning: bool
    # it verifies proposals (speculative decoding): some sequences get several tokens
    speculative: bool = False


class LLMEngine:
    """Owns the scheduler, the runner and every in-flight request. Not thread-safe: EngineLoop
    drives it from one thread when serving; offline callers add requests and step() it.

    The core step, step_outputs(), schedules and computes and returns token ids; the output
    processor turns them into text. step() runs both, so offline a stop string ends its sequence
    before the next step; EngineLoop runs the output processor on a thread of its own.

    With `async_scheduling` the host plans and launches step n+1 while step n computes: the
    tokens step n samples stay on the device and feed step n+1, and the host reads them (for
    outputs, EOS and stop checks) one step later. A sequence that ends at step n has then
    computed one token more, which is dropped, never returned."""

    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase,
                 scheduler: Scheduler, runner: ModelRunner, max_model_len: int, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._requests: dict[int, _Request] = {}  # seq id -> request
        self._ids: dict[str, int] = {}  # request id -> seq id
        self._next_seq_id = 0
        self._seed_rng = random.Random(config.seed)
        self._last_batch: ScheduledBatch | None = None
        self._preemptions_reported = 0  # by last_step_stats, which reports the new ones
        self._spec_reported = (0, 0, 0)  # speculation's counters, likewise
        self._busy_step_seconds = 0.0  # busy steps' time, and their sequences, for the gauges
        self._busy_sequence_steps = 0
        self.phases: PhaseClock = NoPhases()
        self.output_processor = OutputProcessor(tokenizer)
        self._guided: GuidedDecoding | None = None  # see `guided`
        # outputs step_outputs() has not returned yet (also: a grammar that failed at once)
        self._ready: list[StepOutput] = []
        self.async_scheduling = False  # from_config decides (engine/observe/async_check.py)
        self._in_flight: _InFlight | None = None
        self._at_risk: list[ScheduledBatch] = []  # scheduled, tokens not read: a failure ends them
        # disaggregated workers: seq id -> the prompt KV other workers computed, until placed
        self.remote_kv: dict[int, RemoteKV] = {}
        # speculative decoding (engine/spec/): proposes before each schedule, verifies after
        self.speculator: Speculator | None = None
        if config.speculative_method is not None:
            self.speculator = Speculator(
                config.num_speculative_tokens, config.prompt_lookup_min,
                config.prompt_lookup_max, max_model_len, config.speculative_disable_batch_size)
            self.speculator.long_rope_after = scheduler.long_rope_after

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load tokenizer and weights, size the KV pool, build the strategy's scheduler."""
        # Imported here so that `import engine` (the handler choosing a strategy) skips torch.
        from engine.models.loader import eos_token_ids
        from engine.runner.setup import build_rank_zero, settle_triton_mode

        settle_triton_mode(config)  # before anything imports torch's compiler (a tokenizer)

        # Before the rank: its first load imports transformers modules that register pytree
        # types, and compiled attention graphs guard on their number
        # (engine/runner/attention_check.py). Its error waits for the rank's, which names what
        # cannot be served about the model.
        try:
            tokenizer, tokenizer_error = load_tokenizer(config), None
        except Exception as err:
            tokenizer, tokenizer_error = None, err
        rank = build_rank_zero(config)
        runner, spec, plan, max_model_len = rank.runner, rank.spec, rank.kv, rank.max_model_len
        if tokenizer_error is not None:
            close_runner(runner)
            raise tokenizer_error
        scheduler = build_scheduler(config, plan, spec, max_model_len)
        device, dtype = runner.device, runner.kv_cache.dtype
        eos = eos_token_ids(Path(config.model), tokenizer)
        logger.info("engine ready: %s on %s/%s, strategy %s, max_model_len %d%s",
                    spec.architecture, device, dtype, config.batching, max_model_len,
                    f", tensor parallel over {runner.peers.size} ranks" if runner.peers else "")
        logger.info("KV pool: %d blocks of %d tokens, %.1f MiB (sized by %s); at most %d "
                    "sequences of max_model_len at once", plan.num_blocks, plan.block_size,
                    plan.pool_bytes / 2**20, plan.sized_by, plan.max_concurrency)
        engine = cls(config, tokenizer, scheduler, runner, max_model_len, spec.vocab_size, eos)
        if engine.speculator is not None and config.speculative_method == "draft_model":
            from engine.spec.draft import build_draft

            try:
                engine.speculator.draft = build_draft(
                    config, plan.num_blocks * plan.block_size, max_model_len, spec.vocab_size)
            except Exception:
                close_runner(runner)
                raise
        engine.guided.build_in_background()  # ready before the first guided request
        engine.async_scheduling = choose_async_scheduling(engine)
        return engine

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (a one-rank engine holds nothing)."""
        close_runner(self.runner)

    def check_health(self) -> None:
        """WorkerLost when a tensor-parallel worker rank is gone (cheap: polls processes)."""
        peers = getattr(self.runner, "peers", None)
        if peers is not None:
            peers.check()

    # --- requests ---

    @property
    def limits(self) -> RequestLimits:
        """What a request may hold; fixed at start-up, so any thread may read it."""
        return RequestLimits(self.max_model_len, self.scheduler.allocator.max_seq_tokens,
                             self.vocab_size)

    def validate(self, prompt_token_ids: list[int] | tuple[int, ...],
                 params: SamplingParams) -> None:
        """Raise RequestError if this request can never run (empty, too long, bad token ids,
        an adapter that is not registered)."""
        self.limits.validate(prompt_token_ids, params)
        if params.adapter is not None and self._lora_key(params.adapter) is None:
            raise UnknownAdapter(params.adapter, self.adapter_names())

    def add_request(self, request_id: str, prompt_token_ids: list[int] | tuple[int, ...],
                    params: SamplingParams) -> None:
        """Validate and queue a request under a caller-chosen unique id (offline use: step()
        returns its text events)."""
        self.validate(prompt_token_ids, params)
        self.output_processor.add(request_id, params)
        self.add_validated(request_id, GenerationRequest(tuple(prompt_token_ids), params))

    def add_validated(self, request_id: str, request: GenerationRequest,
                      seed: int | None = None) -> Sequence:
        """Queue a request that passed validate(); the core's inbox lands here (its caller
        detokenizes step_outputs() itself). `seed`: its sampling seed when another engine
        drew it (disaggregated decode); returns its sequence."""
        assert request_id not in self._ids, f"duplicate request id {request_id}"
        params = request.params
        if seed is None:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(self._next_seq_id, request.prompt_token_ids, params, self.eos_token_ids,
                       seed)
        self._next_seq_id += 1
        self._requests[seq.seq_id] = _Request(request_id, seq)
        self._ids[request_id] = seq.seq_id
        self.scheduler.add(seq)
        if params.adapter is not None:  # (a boundary in another process may not know it)
            seq.lora_key = self._lora_key(params.adapter)
            if seq.lora_key is None:
                self.scheduler.finish(seq, FinishReason.UNKNOWN_ADAPTER)
                self._ready.append(self._output(self._requests[seq.seq_id], None, error=str(
                    UnknownAdapter(params.adapter, self.adapter_names()))))
                return seq
        if params.guided is not None:
            self._constrain(request_id, seq)
        return seq

    def sequence(self, request_id: str) -> Sequence | None:
        """The sequence of an unfinished request."""
        seq_id = self._ids.get(request_id)
        return None if seq_id is None else self._requests[seq_id].seq

    def detach(self, request_id: str) -> Sequence:
        """Forget a running request without an output (disaggregated prefill hands it on):
        its blocks are freed, those in the prefix cache stay there."""
        seq = self._requests.pop(self._ids.pop(request_id)).seq
        self.output_processor.discard(request_id)
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.remote_kv.pop(seq.seq_id, None)
        return seq

    @property
    def guided(self) -> GuidedDecoding:
        """Guided decoding's grammar state factory (its tokenizer view costs 1-2 s once)."""
        if self._guided is None:
            self._guided = GuidedDecoding(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._guided

    def _constrain(self, request_id: str, seq: Sequence) -> None:
        """Give a guided sequence its grammar state; one that cannot compile against this
        tokenizer ends the request (checked without the tokenizer at the boundary)."""
        assert seq.params.guided is not None  # add() calls it for guided sequences only
        try:
            seq.constraint = self.guided.constraint(seq.params.guided)
            error = seq.constraint.error
        except Exception as err:  # noqa: BLE001 - one request's grammar never stops the core
            error = str(err)
        if error is not None:
            logger.warning("request %s: its grammar failed: %s", request_id, error[:300])
            self.scheduler.finish(seq, FinishReason.INVALID)
            first = error.strip().splitlines()[0][:300] if error.strip() else "unknown error"
            self._ready.append(self._output(self._requests[seq.seq_id], None, error=(
                f"{seq.params.guided.field} does not compile for this model: {first}")))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> StepOutput | None:
        """End a request now and free its KV; returns its final output (None if unknown).
        Offline, step() reports nothing more for it: its caller ended it."""
        self.output_processor.discard(request_id)
        seq_id = self._ids.get(request_id)
        if seq_id is None:
            return None
        self.remote_kv.pop(seq_id, None)
        req = self._requests[seq_id]
        self.scheduler.finish(req.seq, reason)
        return self._output(req, None, error=error)

    def fail_last_batch(self, error: str) -> list[StepOutput]:
        """End every request of the step that raised; returns what is left to report: the
        outputs it had produced, then those endings. Under asynchronous scheduling the step
        launched before it is read first: its tokens stand if the device still gives them
        (only the next launch failed); otherwise its requests end too."""
        self._last_batch = None
        if self._in_flight is not None:
            try:
                self._land_in_flight()
            except Exception:  # noqa: BLE001 - the device failed as well: those requests end
                logger.exception("the step in flight could not be read either")
        batches, self._at_risk = self._at_risk, []
        seqs = dict.fromkeys(s for batch in batches for s in batch.seqs)
        ids = [self._requests[s.seq_id].request_id for s in seqs if s.seq_id in self._requests]
        ended = [out for rid in ids if (out := self.abort(rid, FinishReason.ERROR, error))]
        # The failed steps' KV may be garbage, and their blocks may be published already (at
        # launch, and by the aborts just now): no later prompt may reuse them.
        allocator = self.scheduler.allocator
        if batches and allocator.enable_prefix_caching:
            logger.warning("prefix cache emptied: a failed step's KV cannot be trusted")
            allocator.reset_prefix_cache()
        ready, self._ready = self._ready, []
        return ready + ended

    @property
    def last_batch(self) -> ScheduledBatch | None:
        """The batch of the latest step (None when nothing could run)."""
        return self._last_batch

    def request_ids(self) -> list[str]:
        """Every request not yet finished, queued or running."""
        return list(self._ids)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._ready)
                or self._in_flight is not None)

    @property
    def max_concurrency(self) -> int:
        """Sequences of max_model_len tokens the KV pool holds at once."""
        allocator = self.scheduler.allocator
        return max_concurrency(allocator.num_blocks, allocator.block_size, self.max_model_len,
                               self.runner.layout)

    # --- LoRA adapters (engine/lora/) ---

    def add_adapter(self, name: str, path: str) -> None:
        """Register the PEFT folder `path` as `name`: the next request may name it. Raises
        AdapterError (why it is refused) or RuntimeError (LoRA is off)."""
        self._registry().register(name, path)
        logger.info("LoRA adapter %s registered from %s", name, path)

    def remove_adapter(self, name: str) -> None:
        """New requests may no longer name it; those using it finish first. Raises
        AdapterNotFound."""
        self._registry().unregister(name, self._lora_keys_in_use())
        logger.info("LoRA adapter %s unregistered", name)

    def adapter_names(self) -> list[str]:
        """The adapters requests may name ([] when LoRA is off)."""
        registry = self.runner.adapters
        return sorted(registry.current) if registry is not None else []

    def adapter_path(self, name: str) -> str | None:
        registry, key = self.runner.adapters, self._lora_key(name)
        return registry.path_of(key) if registry is not None and key is not None else None

    def _lora_key(self, name: str) -> str | None:
        registry = self.runner.adapters
        return registry.key_of(name) if registry is not None else None

    def _registry(self) -> AdapterRegistry:
        if self.runner.adapters is None:
            raise RuntimeError("LoRA is not enabled (option.enable_lora=true)")
        return self.runner.adapters

    def _lora_keys_in_use(self) -> set[str]:
        seqs = [*self.scheduler.waiting, *self.scheduler.running]
        return {seq.lora_key for seq in seqs if seq.lora_key is not None}

    # --- the step ---

    def step(self) -> list[TokenEvent]:
        """Run one iteration; returns one event per request that got a token or finished."""
        events, stopped = self.output_processor.process(self.step_outputs())
        for request_id in stopped:  # a stop string: end it before the next step is planned
            self.abort(request_id, FinishReason.STOP)
        self.phases.mark("detokenize")
        return events

    def step_outputs(self) -> list[StepOutput]:
        """The core step, schedule → run → postprocess: one output per request that got a token
        or finished, with token ids only (no text, no stop strings)."""
        self._last_batch = None
        self.phases.start()
        if self.async_scheduling:
            self._step_ahead()
        else:
            batch = self._schedule()
            if batch is not None:
                self._land(self._launch(batch))
        self.phases.mark("postprocess")
        registry = self.runner.adapters
        if registry is not None and len(registry.paths) > len(registry.current):  # retiring
            registry.forget_unused(self._lora_keys_in_use())
        ready, self._ready = self._ready, []  # taken only now: a step that raises keeps them
        return ready

    def _step_ahead(self) -> None:
        """Plan and launch the next step, then read the previous one's tokens while it runs."""
        if self._in_flight is not None and self._in_flight.blocks_planning:
            self._land_in_flight()
        batch = self._schedule()
        if batch is None and self._in_flight is not None:  # its tokens may end or free some
            self._land_in_flight()
            batch = self._schedule()
        launched = self._launch(batch) if batch is not None else None
        if self._in_flight is not None:
            self._land_in_flight()
        self._in_flight = launched

    def _schedule(self) -> ScheduledBatch | None:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self._last_batch = self.scheduler.schedule()
        if self.speculator is not None:  # proposals of sequences not scheduled now go
            scheduled = set(batch.seqs) if batch is not None else set()
            for seq in self.scheduler.running:
                if seq.num_drafts and seq not in scheduled:
                    seq.withdraw_drafts()
        if batch is not None:
            self._at_risk.append(batch)
            if self.remote_kv:
                self._place_remote_kv(batch)
        self.phases.mark("schedule")
        return batch

    def _place_remote_kv(self, batch: ScheduledBatch) -> None:
        """Sequences admitted with another worker's KV get it written into their blocks now;
        once scheduled, what they hold is no longer needed either way."""
        for seq in batch.seqs:
            kv = self.remote_kv.pop(seq.seq_id, None)
            if kv is not None and seq.kv_import_start is not None:
                kv.place(self.runner, seq, seq.kv_import_start)
            seq.kv_import_start = None

    def _launch(self, batch: ScheduledBatch) -> _InFlight:
        """Queue the batch on the device and count its tokens as computed."""
        blocks = any(seq.needs_known_tokens for i, seq in enumerate(batch.seqs)
                     if batch.is_sampled(i))
        result = self.runner.launch(batch)  # marks prepare, forward and sample
        self.scheduler.advance(batch)
        return _InFlight(batch, result, blocks, any(seq.num_drafts for seq in batch.seqs))

    def _land_in_flight(self) -> None:
        step, self._in_flight = self._in_flight, None
        assert step is not None  # callers check that a step is in flight
        self._land(step)

    def _land(self, step: _InFlight) -> None:
        """Read a launched step's tokens: append them, retire what they end, and queue their
        outputs (the batch is then no longer at risk)."""
        if step.speculative:
            self._land_speculative(step)
            return
        samples = step.result.tokens()
        self.scheduler.resolve(step.batch, samples)
        self._at_risk = [batch for batch in self._at_risk if batch is not step.batch]
        self._ready += self._outputs(step.batch, samples)

    def _land_speculative(self, step: _InFlight) -> None:
        """A step that verified proposals: each such sequence takes its accepted proposals and
        one more token (one output each, in order); the others land as usual."""
        assert self.speculator is not None  # only it proposes
        samples: list[SampledToken | None] = []
        taken: dict[int, tuple[int, list[SampledToken]]] = {}  # seq id -> (outputs before, …)
        for seq, rows in zip(step.batch.seqs, step.result.rows_by_seq(), strict=True):
            if not (seq.num_drafts and rows and not seq.is_finished):
                samples.append(rows[-1] if rows else None)
                continue
            before = seq.num_verified_tokens - seq.num_prompt_tokens
            drafts = seq.token_ids[-seq.num_drafts - 1:-1]
            yielded = self.speculator.verify(seq, drafts, rows)
            count = self.scheduler.take_speculated(seq, [t.token_id for t in yielded])
            self.speculator.count(len(drafts), count)
            taken[seq.seq_id] = (before, yielded[:count])
            samples.append(None)  # taken above
        self.scheduler.resolve(step.batch, samples)
        self._at_risk = [batch for batch in self._at_risk if batch is not step.batch]
        self.speculator.log_metrics()
        for seq, sample in zip(step.batch.seqs, samples, strict=True):
            req = self._requests.get(seq.seq_id)
            if req is None:
                continue
            if sample is not None:
                self._ready.append(self._output(req, sample))
            elif seq.seq_id in taken:
                self._ready += self._outputs_of(req, *taken[seq.seq_id])

    def _outputs_of(self, req: _Request, before: int,
                    tokens: list[SampledToken]) -> list[StepOutput]:
        """One output per token a verifying step gave `req`; the last carries its ending."""
        seq = req.seq
        outputs = [StepOutput(req.request_id, t.token_id, t.logprob, seq.num_prompt_tokens,
                              before + j, None, None, t.top_logprobs)
                   for j, t in enumerate(tokens[:-1], start=1)]
        return outputs + [self._output(req, tokens[-1])]

    def measure_phases(self, phases: PhaseClock) -> None:
        """Time each phase of later steps with `phases` (NoPhases turns it off)."""
        self.phases = phases
        self.runner.measure(phases)

    def last_step_stats(self, seconds: float) -> StepStats:
        """Facts about the step just run, for metrics."""
        batch, allocator = self._last_batch, self.scheduler.allocator
        preempted = self.scheduler.num_preemptions - self._preemptions_reported
        self._preemptions_reported = self.scheduler.num_preemptions
        num_seqs = len(batch.seqs) if batch else 0
        spec = self._spec_since_last_stats()
        if num_seqs >= self.config.busy_step_sequences:
            self._busy_step_seconds += seconds
            self._busy_sequence_steps += num_seqs
        return StepStats(
            num_seqs=num_seqs,
            num_prefill_tokens=batch.num_prefill_tokens if batch else 0,
            num_decode_tokens=batch.num_decode_tokens if batch else 0,
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            kv_blocks_used=allocator.num_used_blocks, kv_blocks_total=allocator.num_blocks,
            num_preemptions=preempted, step_seconds=seconds,
            graph=batch is not None and self.runner.last_step_graph,
            spec_drafts=spec[0], spec_draft_tokens=spec[1], spec_accepted_tokens=spec[2])

    def _spec_since_last_stats(self) -> tuple[int, int, int]:
        """Speculative decoding's counters since the previous call (zeros without it)."""
        if self.speculator is None:
            return 0, 0, 0
        c = self.speculator.counters
        now = (c.drafts, c.draft_tokens, c.accepted_tokens)
        before, self._spec_reported = self._spec_reported, now
        return now[0] - before[0], now[1] - before[1], now[2] - before[2]

    def gauges(self) -> Gauges:
        """The scheduler's and the pool's state now (call on the thread that steps)."""
        allocator = self.scheduler.allocator
        queries = getattr(allocator, "prefix_queries", 0)  # only the paged pool has a cache
        hit_rate = getattr(allocator, "prefix_hits", 0) / queries if queries else 0.0
        return Gauges(
            alive=True, num_in_flight=len(self._requests),
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            kv_blocks_used=allocator.num_used_blocks, kv_blocks_total=allocator.num_blocks,
            kv_block_size=allocator.block_size, max_concurrency=self.max_concurrency,
            prefix_cache_hit_rate=hit_rate, busy_step_seconds=self._busy_step_seconds,
            busy_sequence_steps=self._busy_sequence_steps)

    def _outputs(self, batch: ScheduledBatch,
                 samples: list[SampledToken | None]) -> list[StepOutput]:
        return [self._output(req, sample)
                for seq, sample in zip(batch.seqs, samples, strict=True)
                if sample is not None and (req := self._requests.get(seq.seq_id)) is not None]

    def _output(self, req: _Request, sample: SampledToken | None,
                error: str | None = None) -> StepOutput:
        seq = req.seq
        reason = seq.finish_reason.value if seq.finish_reason else None
        if reason is not None:
            del self._requests[seq.seq_id]
            del self._ids[req.request_id]
            if error is None and seq.finish_reason is FinishReason.INVALID:
                error = _grammar_failure(req.request_id, seq)
        if sample is None:
            return StepOutput(req.request_id, None, None, seq.num_prompt_tokens,
                              seq.num_known_output_tokens, reason, error)
        return StepOutput(req.request_id, sample.token_id, sample.logprob, seq.num_prompt_tokens,
                          seq.num_known_output_tokens, reason, error, sample.top_logprobs)


def _grammar_failure(request_id: str, seq: Sequence) -> str:
    """Why a sequence's grammar ended it while generating (check() refuses what it can see
    before; a path it did not follow may still blow up the parser), logged: a 4xx's message."""
    why = (seq.constraint.error if seq.constraint is not None else None) or "unknown error"
    first = why.strip().splitlines()[0][:300] if why.strip() else "unknown error"
    field = seq.params.guided.field if seq.params.guided is not None else "guided"
    logger.warning("request %s: its grammar (%s) failed after %d tokens: %s", request_id,
                   field, seq.num_known_output_tokens, first)
    return (f"{field} failed while generating after {seq.num_known_output_tokens} tokens: "
            f"{first}")


def close_runner(runner: ModelRunner) -> None:
    peers = getattr(runner, "peers", None)
    if peers is None:
        return
    from engine.parallel.comm import leave_group

    peers.stop()
    runner.use_peers(None)
    leave_group()
