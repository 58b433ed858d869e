"""What the transformers fallback costs: `bench model-impl` runs the same requests through the
offline engine twice, on a native architecture's own modules and then with
model_impl=transformers (transformers' modules on batchyard's KV pool), and reports output
tokens/s of each. Figures, not tests."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from benchmark.constrained import run_full_batch, write_report

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("model-impl", help="native vs transformers-fallback throughput, offline")
    p.add_argument("--model-dir", type=Path, help="a native architecture (default: the "
                   "embedded default model, a Llama)")
    p.add_argument("--batch", type=int, default=32, help="sequences in flight")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--strategy", choices=("continuous", "paged"), default="paged")
    p.add_argument("--out", type=Path, help="write model-impl.json here")


def run(args: argparse.Namespace) -> int:
    from engine import EngineConfig, LLMEngine, SamplingParams
    from handler.model_source.default_model import ensure_default_model

    results: dict = {"batch": args.batch, "requests": args.requests,
                     "new_tokens": args.new_tokens, "strategy": args.strategy}
    params = SamplingParams(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                            ignore_eos=True)
    for impl in ("native", "transformers"):
        config = EngineConfig(model=str(args.model_dir or ensure_default_model()),
                              batching=args.strategy, max_num_seqs=args.batch,
                              max_model_len=512, dtype="float32", model_impl=impl)
        started = time.perf_counter()
        engine = LLMEngine.from_config(config)
        load_s = time.perf_counter() - started
        prompt = engine.tokenizer.encode("Once upon a time, in a quiet town by the sea,")
        run_full_batch(engine, prompt, [params] * args.batch)  # warm-up
        seconds, lengths = run_full_batch(engine, prompt, [params] * args.requests)
        results[impl] = {"tokens_per_s": round(sum(lengths) / seconds, 1),
                         "load_s": round(load_s, 1)}
    results["ratio"] = round(results["transformers"]["tokens_per_s"]
                             / results["native"]["tokens_per_s"], 3)
    write_report(results, args.out, "model-impl.json")
    logger.debug("%s", json.dumps(results))
    return 0
