"""CPU rehearsal of a served burst with FlexAttention: does any step compile after the warm-up?

FlexAttention is forced on the CPU and compiled for every query bucket as on CUDA; then prompts
are admitted one per step and ten at once beside running decodes (the served arrival pattern),
with TORCH_LOGS=recompiles on. Prints dynamo's graph count after the warm-up and at the end, and
any step over 0.5 s (a C++ compile on this CPU takes seconds).

    PYTHONPATH=. python docs/benchmark/gpu-h100-2026-11-26/flex_rehearsal.py MODEL_DIR
(2-vCPU EPYC, tiny test model, 2026-11-26: 6 graphs after the warm-up, 6 at the end, no slow step)
"""

import logging
import sys
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoTokenizer

from benchmark.workloads import lmi_jobs
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.attention.check import warm_up_attention

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
model = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
engine = LLMEngine.from_config(EngineConfig(
    model=model, batching="paged", dtype="float32", device="cpu", max_num_seqs=32,
    max_model_len=256, num_kv_blocks=1024, attention_backend="flex", padded_decode_on_cpu=True,
    max_num_batched_tokens=512))
started = time.time()
print("warm-up buckets", warm_up_attention(engine.runner, 512), f"{time.time() - started:.1f} s")
print("dynamo after the warm-up", dict(counters["stats"]), flush=True)
torch._logging.set_logs(recompiles=True)
jobs = lmi_jobs(96)
added = 0
slow = []


def add(count: int) -> None:
    global added
    for _ in range(count):
        job = jobs[added % len(jobs)]
        n = job.new_tokens // 4  # the tiny model's 256 positions
        engine.add_request(f"r{added}", tok.encode(job.prompt),
                           SamplingParams(max_new_tokens=n, min_new_tokens=n, ignore_eos=True))
        added += 1


def steps(count: int) -> None:
    for _ in range(count):
        if not engine.has_unfinished():
            return
        t = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t
        batch = engine.last_batch
        if seconds > 0.5 and batch is not None:
            slow.append((round(seconds, 2), batch.num_prefill_tokens, batch.num_decode_tokens))


add(3)
steps(5)
for _ in range(29):  # one arrival per step
    add(1)
    steps(1)
steps(10)
add(10)  # a burst beside running decodes
steps(3)
for _ in range(20):
    add(1)
    steps(2)
while engine.has_unfinished():
    steps(1)
print("dynamo at the end", dict(counters["stats"]), "slow steps (s, prompt, decode):", slow)
engine.close()
