"""What leaves the engine: sampled tokens (runner to scheduler) and token events (to callers)."""

from __future__ import annotations

from typing import NamedTuple


class SampledToken(NamedTuple):
    """One token the runner sampled for a sequence whose KV caught up with its tokens (a named
    tuple: one per running sequence per step, a third of a frozen dataclass's cost to build)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), best first


class TokenEvent(NamedTuple):
    """One step's news for one request: a new token (with its text delta), its end, or both.

    `text` is the text this token completes: it may be "" for the first bytes of a multi-byte
    character and hold the whole character on the token that completes it, so the deltas
    always concatenate to the decoded output. A named tuple: the serving process makes one per
    token of every stream (~0.2 us; a frozen dataclass took ~0.75).
    """

    request_id: str
    token_id: int | None
    text: str
    logprob: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepStats(NamedTuple):
    """Per-step facts for metrics: batch size, token split and KV occupancy. A named tuple,
    as Gauges: the core makes one every step and pickles it to the serving process."""

    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int  # since the previous StepStats (each counted once)
    step_seconds: float
    graph: bool = False  # the step replayed a CUDA graph (else it ran eagerly)
    # speculative decoding, since the previous StepStats: proposals verified, tokens proposed,
    # tokens accepted (vLLM's spec_decode counters)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class Gauges(NamedTuple):
    """The engine's state in one snapshot, for /ping, /metrics and the HTTP threads' CPU
    priority (handler/cpu_priority.py); taken on the loop thread before each batch of events
    is handed out, so a finished request is already counted. A named tuple: the core takes one
    every step (~0.5 us to build; a frozen dataclass took ~1.3)."""

    alive: bool  # the loop runs and accepts work
    num_in_flight: int  # submitted and not yet finished (queued in the inbox included)
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_size: int  # tokens per block; max_model_len for the contiguous strategies
    max_concurrency: int  # sequences of max_model_len tokens the pool holds at once
    prefix_cache_hit_rate: float  # prompt blocks found / looked up; 0 without prefix caching
    # What a busy step costs per sequence: the time of every step since start-up that held at
    # least EngineConfig.busy_step_sequences sequences (as timed for StepStats), and their
    # sequences summed (a batch of 8: 8)
    busy_step_seconds: float = 0.0
    busy_sequence_steps: int = 0


class Handoff(NamedTuple):
    """A disaggregated prefill worker's news (engine/disagg/): the prompt of `request_id` is
    prefilled and its first token sampled; its KV goes from worker `src` to worker `dst`,
    where the decode goes on with the same sampling seed."""

    request_id: str
    token_id: int
    seed: int
    num_kv_tokens: int
    src: int
    dst: int
