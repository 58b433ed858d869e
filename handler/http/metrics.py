"""Prometheus metrics: request outcomes and latencies from the handler, step facts from the loop."""

from __future__ import annotations

import os
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from engine import Gauges, StepStats

# Set (by `batchyard serve`, before this module is imported) when several HTTP processes serve:
# each writes its samples there and a scrape of any one of them sums them all.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 128, 256)
# vLLM's iteration_tokens buckets, with 48 and 96: a CUDA graph's row cap at 32 sequences is 96
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def _gauge(name: str, documentation: str, registry: CollectorRegistry) -> Gauge:
    # The engine's gauges, set at scrape time by the process scraped: with several, its value
    # is the newest of the live ones (a dead worker's are dropped: server.py's child_exit).
    return Gauge(name, documentation, registry=registry, multiprocess_mode="livemostrecent")


def observe_all(histogram: Histogram, amounts: Sequence[float]) -> None:
    """histogram.observe(a) for every amount, as one update per bucket touched: a stream's
    inter-token gaps come one per token, and observe() takes a lock per value and per sum
    (~0.5 us each: ~30 us of every 64-token request). Exposition and multiprocess files are
    as with observe(); the sum may differ in its last bits (added once, not value by value).
    Finite amounts, as time gaps are."""
    bounds, buckets, total = (getattr(histogram, name, None)
                              for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:  # not prometheus_client's layout
        for amount in amounts:
            histogram.observe(amount)
        return
    if not amounts:
        return
    # observe() counts an amount in the first bucket whose bound is >= it: bisect_left's index
    for index, count in Tally(bisect_left(bounds, amount) for amount in amounts).items():
        buckets[index].inc(count)
    total.inc(sum(amounts))


class Metrics:
    """One registry per server process (one gunicorn worker); with several, /metrics from any
    of them reports all (counters and histograms summed, gauges as last set)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._shared = bool(os.environ.get(MULTIPROC_ENV))
        self.requests = Counter("batchyard_requests", "Requests by HTTP status", ["status"],
                                registry=r)
        self.aborted = Counter(
            "batchyard_aborted_requests",
            "Requests ended before they finished, by reason (client_disconnect, shutdown, "
            "timeout, error)", ["reason"], registry=r)
        self.streams = Counter(
            "batchyard_streamed_requests",
            "Streamed responses by the thread that wrote them: output_thread (the engine's "
            "output thread, one write per step), request_thread, or handed_back (the output "
            "thread until the client fell behind)", ["writer"], registry=r)
        self.ttft = Histogram("batchyard_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("batchyard_inter_token_latency_seconds", "Gap between tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("batchyard_e2e_request_latency_seconds", "Request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("batchyard_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("batchyard_generation_tokens", "Generated tokens",
                                         registry=r)
        self.batch_size = Histogram("batchyard_batch_size", "Sequences per engine step",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.decode_batch_size = Histogram(
            "batchyard_decode_batch_size", "Decoding sequences per engine step that decodes",
            buckets=_BATCH_BUCKETS, registry=r)
        self.kv_usage = Histogram("batchyard_kv_cache_usage_ratio",
                                  "Fraction of the KV pool in use after each engine step",
                                  buckets=_RATIO_BUCKETS, registry=r)
        self.step_tokens = Counter("batchyard_step_tokens", "Tokens computed by engine steps",
                                   ["kind"], registry=r)
        self.iteration_tokens = Histogram(
            "batchyard_iteration_tokens", "Tokens per engine step (prefill and decode; as "
            "vLLM's iteration_tokens_total): steps past the CUDA graphs' row cap run eagerly",
            buckets=_STEP_TOKEN_BUCKETS, registry=r)
        self.graph_steps = Counter(
            "batchyard_graph_steps", "Engine steps replayed as a CUDA graph (the rest of "
            "batchyard_step_seconds_count ran eagerly)", registry=r)
        self.step_seconds = Histogram("batchyard_step_seconds", "Engine step duration",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.preemptions = Counter("batchyard_preemptions", "Sequences preempted (recompute)",
                                   registry=r)
        # speculative decoding (vLLM's spec_decode counters): acceptance rate = accepted /
        # draft tokens; mean acceptance length = 1 + accepted / drafts
        self.spec_drafts = Counter("batchyard_spec_decode_num_drafts",
                                   "Proposals verified (one per sequence and step)", registry=r)
        self.spec_draft_tokens = Counter("batchyard_spec_decode_num_draft_tokens",
                                         "Tokens proposed", registry=r)
        self.spec_accepted_tokens = Counter("batchyard_spec_decode_num_accepted_tokens",
                                            "Proposed tokens accepted", registry=r)
        self.queue_depth = _gauge("batchyard_queue_depth", "Requests waiting", r)
        self.running = _gauge("batchyard_running_sequences", "Sequences running", r)
        self.kv_used = _gauge("batchyard_kv_blocks_used", "KV blocks in use", r)
        self.kv_total = _gauge("batchyard_kv_blocks_total", "KV blocks in the pool", r)
        self.kv_block_size = _gauge(
            "batchyard_kv_block_size",
            "Tokens per KV block (max_model_len for contiguous strategies)", r)
        self.max_concurrency = _gauge(
            "batchyard_kv_max_concurrency",
            "Sequences of max_model_len tokens the KV pool holds at once", r)
        self.prefix_hit_rate = _gauge("batchyard_prefix_cache_hit_rate",
                                      "Prompt blocks found in the prefix cache / looked up", r)
        # By LoRA adapter ("base": none); the plain counters above keep their one label set.
        # At most `adapter_labels` names get a series of their own, later ones count as
        # "other": adapters registered and removed at run time cannot grow the label set.
        self.adapter_requests = Counter("batchyard_adapter_requests",
                                        "Requests by LoRA adapter and HTTP status",
                                        ["adapter", "status"], registry=r)
        self.adapter_tokens = Counter("batchyard_adapter_tokens",
                                      "Prompt and generated tokens by LoRA adapter",
                                      ["adapter", "kind"], registry=r)
        self.adapter_labels = 0  # set by the server: max_cpu_loras + adapters at start-up
        self._adapter_seen: set[str] = set()
        self._gauges: Callable[[], Gauges] | None = None

    def watch(self, gauges: Callable[[], Gauges]) -> None:
        """Read the engine's gauges at scrape time (correct even when idle)."""
        self._gauges = gauges

    def on_step(self, stats: StepStats) -> None:
        """Called by the engine loop after every step."""
        self.batch_size.observe(stats.num_seqs)
        if stats.num_decode_tokens:
            self.decode_batch_size.observe(stats.num_decode_tokens)
        self.kv_usage.observe(stats.kv_blocks_used / max(1, stats.kv_blocks_total))
        self.step_tokens.labels("prefill").inc(stats.num_prefill_tokens)
        self.step_tokens.labels("decode").inc(stats.num_decode_tokens)
        self.iteration_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)
        self.step_seconds.observe(stats.step_seconds)
        if stats.graph:
            self.graph_steps.inc()
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        if stats.spec_drafts:
            self.spec_drafts.inc(stats.spec_drafts)
            self.spec_draft_tokens.inc(stats.spec_draft_tokens)
            self.spec_accepted_tokens.inc(stats.spec_accepted_tokens)

    def on_request(self, status: int, prompt_tokens: int, token_times: list[float],
                   start: float, end: float, adapter: str | None = None) -> None:
        """A finished request: its status, tokens and the monotonic times of its tokens;
        `adapter` its LoRA adapter (counted by adapter only where LoRA is on)."""
        self.requests.labels(str(status)).inc()
        if self.adapter_labels:
            label = self._adapter_label(adapter)
            self.adapter_requests.labels(label, str(status)).inc()
            self.adapter_tokens.labels(label, "prompt").inc(prompt_tokens)
            self.adapter_tokens.labels(label, "generation").inc(len(token_times))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(len(token_times))
        if token_times:
            self.ttft.observe(token_times[0] - start)
            observe_all(self.itl, [after - before for before, after
                                   in zip(token_times, token_times[1:], strict=False)])
        self.e2e.observe(end - start)

    def _adapter_label(self, adapter: str | None) -> str:
        if not adapter:
            return "base"
        if adapter in self._adapter_seen or len(self._adapter_seen) < self.adapter_labels:
            self._adapter_seen.add(adapter)  # under the GIL: a race costs one label at most
            return adapter
        return "other"

    def on_stream(self, writer: str) -> None:
        self.streams.labels(writer).inc()

    def on_abort(self, reason: str) -> None:
        self.aborted.labels(reason).inc()

    def render(self) -> bytes:
        if self._gauges is not None:  # one snapshot, so the gauges agree with each other
            now = self._gauges()
            self.queue_depth.set(now.num_waiting)
            self.running.set(now.num_running)
            self.kv_used.set(now.kv_blocks_used)
            self.kv_total.set(now.kv_blocks_total)
            self.kv_block_size.set(now.kv_block_size)
            self.max_concurrency.set(now.max_concurrency)
            self.prefix_hit_rate.set(now.prefix_cache_hit_rate)
        if not self._shared:
            return generate_latest(self.registry)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process)
        return generate_latest(every_process)
