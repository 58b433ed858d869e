"""The offline engine, three waves of 32 LMI requests at once: each step timed, the slowest listed.

    PYTHONPATH=. python docs/benchmark/gpu-h200-2026-11-26-b/waves.py MODEL_DIR STRATEGY PROFILE
PROFILE 1: wave 1 under torch.profiler (CPU activities). Environment: DEVICE (cuda), DTYPE
(bfloat16), MAXLEN (2048). Run on the H200 with TORCH_LOGS=recompiles, to see whether a step
compiles while serving; the KV budget is the sweep's 2 GiB.
"""
import logging
import os
import sys
import time

import torch
from transformers import AutoTokenizer

from benchmark.workloads import lmi_jobs
from engine import EngineConfig, LLMEngine, SamplingParams

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
model, strategy, profile_first = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
config = EngineConfig(model=model, batching=strategy, dtype=os.environ.get("DTYPE", "bfloat16"),
                      device=os.environ.get("DEVICE", "cuda"),
                      max_num_seqs=32, max_model_len=int(os.environ.get("MAXLEN", 2048)),
                      kv_cache_memory=2 << 30,
                      max_num_batched_tokens=512 if strategy == "paged" else None)
engine = LLMEngine.from_config(config)


def wave(tag: str) -> None:
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


if profile_first:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wave("w1")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
else:
    wave("w1")
wave("w2")
wave("w3")
engine.close()
