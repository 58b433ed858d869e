"""What KV groups buy a model mixing full and windowed layers: `bench kv-groups` runs the same
requests through the offline paged engine twice with the same KV memory, with a block table per
group of layers (windowed layers keep only their window; engine/kv/layout.py) and with one
table (every layer keeps every position), and reports tokens/s, how many sequences of
max_model_len the pool holds, the mean batch and the preemptions. Figures, not tests."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from benchmark.constrained import write_report

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("kv-groups", help="a windowed model's throughput with and without KV "
                       "groups, same KV memory, offline")
    p.add_argument("model_dir", type=Path, help="a model mixing full and windowed layers "
                   "(e.g. `bench random-model DIR --preset gemma3-small`)")
    p.add_argument("--kv-memory-mib", type=float, default=16.0, help="KV pool for both runs")
    p.add_argument("--batch", type=int, default=32, help="max_rolling_batch_size")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--out", type=Path, help="write kv-groups.json here")


def run(args: argparse.Namespace) -> int:
    from engine import EngineConfig, LLMEngine, SamplingParams

    results: dict = {"model": args.model_dir.name, "kv_memory_mib": args.kv_memory_mib,
                     "batch": args.batch, "requests": args.requests,
                     "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    params = SamplingParams(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                            ignore_eos=True)
    max_len = args.prompt_tokens + args.new_tokens
    for groups in (True, False):
        config = EngineConfig(model=str(args.model_dir), batching="paged",
                              max_num_seqs=args.batch, max_model_len=max_len, dtype="float32",
                              kv_cache_memory=int(args.kv_memory_mib * 2**20),
                              kv_groups=groups)
        engine = LLMEngine.from_config(config)
        prompts = [[3 + (i * 7 + j) % 200 for j in range(args.prompt_tokens)]
                   for i in range(args.requests)]
        seconds, steps, batch_rows = _run_all(engine, prompts, params)
        results["groups" if groups else "one_table"] = {
            "tables": engine.runner.layout.num_tables,
            "max_concurrency": engine.max_concurrency,
            "tokens_per_s": round(args.requests * args.new_tokens / seconds, 1),
            "mean_batch": round(batch_rows / steps, 1),
            "preemptions": engine.scheduler.num_preemptions}
    results["ratio"] = round(results["groups"]["tokens_per_s"]
                             / results["one_table"]["tokens_per_s"], 3)
    write_report(results, args.out, "kv-groups.json")
    logger.debug("%s", json.dumps(results))
    return 0


def _run_all(engine, prompts: list[list[int]], params) -> tuple[float, int, int]:
    """Every request queued at once; returns (seconds, steps, sequences run over the steps)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    steps = rows = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        rows += len(engine.scheduler.running)
    return time.perf_counter() - started, steps, rows
