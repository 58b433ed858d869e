"""Decode stalls: how long running requests wait between tokens while a long prompt arrives.

Stall-free batching (Sarathi-Serve) prefills a long prompt in budget-sized chunks mixed with
the running decodes; without chunking the whole prompt runs in one step and every running
request waits for it. Run once with chunked prefill on and once off, and compare the p99.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmark.loadgen import HTTPTarget, RequestResult, percentiles
from benchmark.workloads import LMI_WORKLOAD, Job


@dataclass
class StallReport:
    """Inter-token latency of the running requests, and the long prompt's own latency."""

    num_decoders: int
    long_prompt_tokens: int
    long_prompt_latency_s: float
    inter_token: dict[str, float]
    max_inter_token_s: float
    errors: int


def long_prompt(model_dir: Path, num_tokens: int) -> str:
    """Text of about `num_tokens` tokens for the model's tokenizer (prose, not one repeated id)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    sentence = " ".join(job.prompt for job in LMI_WORKLOAD) + ". "
    ids = tokenizer.encode(sentence * (num_tokens // 20 + 1), add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])


def run_stall(url: str, prompt: str, decoders: int = 8, decode_tokens: int = 64,
              settle_tokens: int = 8, timeout: float = 600.0) -> StallReport:
    """Start `decoders` streams; once each has `settle_tokens` tokens, send the long prompt."""
    target = HTTPTarget(url, timeout)
    results: list[RequestResult | None] = [None] * decoders
    job = Job(LMI_WORKLOAD[0].prompt, decode_tokens)
    progress = [0] * decoders

    def decode(i: int) -> None:
        results[i] = target.send(job, stream=True, on_token=lambda n: progress.__setitem__(i, n))
        progress[i] = settle_tokens  # finished (or failed): never hold the long prompt back

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(decoders)]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    while min(progress) < settle_tokens and time.monotonic() < end and any(
            t.is_alive() for t in threads):
        time.sleep(0.01)
    long = target.send(Job(prompt, 1), stream=False)
    for t in threads:
        t.join()
    done = [r for r in results if r is not None and r.ok]
    gaps = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    return StallReport(decoders, long.num_prompt_tokens, long.end - long.start, percentiles(gaps),
                       max(gaps, default=0.0), decoders - len(done) + (0 if long.ok else 1))
