"""The offline engine (LLMEngine.step() in a closed loop, no HTTP) on raw_client.py's workload:
32 clients, 24-token prompts, 64 new tokens.

    PYTHONPATH=. python docs/benchmark/cpu-2026-11-26-direct-streams/offline.py PROPERTIES [N]

MODEL (default /tmp/tiny320) and DTYPE (default float32) in the environment pick another model,
as scripts/gpu_check.sh's ratio check does on a GPU.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from benchmark.peer_engine import build_engine, engine_loop
from benchmark.workloads import Lengths, synthetic_jobs

MODEL = Path(os.environ.get("MODEL", "/tmp/tiny320"))
DTYPE = os.environ.get("DTYPE", "float32")
CLIENTS = 32


def main() -> None:
    properties, n = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1280
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    jobs = synthetic_jobs(n + CLIENTS, Lengths.parse("24", "prompt"),
                          Lengths.parse("64", "output"), 0, tokenizer)
    requests = [{"prompt_ids": tokenizer(job.prompt)["input_ids"], "new_tokens": job.new_tokens}
                for job in jobs]
    engine, _ = build_engine(properties, MODEL, DTYPE, None)
    engine_loop(engine, requests[:CLIENTS], CLIENTS, "w")  # warm-up, not timed
    start = time.perf_counter()
    results, _ = engine_loop(engine, requests[CLIENTS:], CLIENTS, "r")
    print(f"offline {len(results) / (time.perf_counter() - start):.1f} req/s")


if __name__ == "__main__":
    main()
