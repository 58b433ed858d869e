"""The offline engine, three waves of 32 LMI requests at once: each step timed, the slowest listed.

    python -m benchmark.tools.waves MODEL_DIR STRATEGY PROFILE

PROFILE 1: wave 1 under torch.profiler (CPU activities). Environment: DEVICE (cuda), DTYPE
(bfloat16), MAXLEN (2048). Run on the H200 with TORCH_LOGS=recompiles, to see whether a step
compiles while serving; the KV budget is the sweep's 2 GiB. Written for the H200 run
docs/benchmark/gpu-h200-2026-11-26-b/ ("Not compilation"): its waves ruled out recompiles there.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
from transformers import AutoTokenizer

from benchmark.workloads import lmi_jobs
from engine import EngineConfig, LLMEngine, SamplingParams


def wave(engine: LLMEngine, tok, strategy: str, tag: str) -> None:
    for i, job in enumerate(lmi_jobs(32)):
        p = SamplingParams(max_new_tokens=job.new_tokens, min_new_tokens=job.new_tokens,
                           ignore_eos=True)
        engine.add_request(f"{tag}-{i}", tok.encode(job.prompt), p)
    times = []
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        b = engine.last_batch
        times.append(((time.perf_counter() - t) * 1000, b.num_prefill_tokens if b else -1,
                      b.num_decode_tokens if b else -1, len(times)))
    total = time.perf_counter() - start
    slow = sorted(times, reverse=True)[:8]
    print(f"{strategy} {tag}: {len(times)} steps in {total:.3f} s; slowest (ms, prefill, "
          f"decode, step#): " + "; ".join(f"{m:.1f},{p},{d},#{n}" for m, p, d, n in slow),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.waves",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="a model folder (e.g. bench random-model's)")
    parser.add_argument("strategy", help="none, dynamic, continuous or paged")
    parser.add_argument("profile", choices=("0", "1"), help="1: wave 1 under torch.profiler")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    model, strategy = args.model_dir, args.strategy
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    config = EngineConfig(model=model, batching=strategy,
                          dtype=os.environ.get("DTYPE", "bfloat16"),
                          device=os.environ.get("DEVICE", "cuda"),
                          max_num_seqs=32, max_model_len=int(os.environ.get("MAXLEN", 2048)),
                          kv_cache_memory=2 << 30,
                          max_num_batched_tokens=512 if strategy == "paged" else None)
    engine = LLMEngine.from_config(config)
    if args.profile == "1":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wave(engine, tok, strategy, "w1")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25),
              flush=True)
    else:
        wave(engine, tok, strategy, "w1")
    wave(engine, tok, strategy, "w2")
    wave(engine, tok, strategy, "w3")
    engine.close()


if __name__ == "__main__":
    main()
