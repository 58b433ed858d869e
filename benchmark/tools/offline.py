"""The offline engine (LLMEngine.step() in a closed loop, no HTTP) on raw_client.py's workload:
32 clients, 24-token prompts, 64 new tokens.

    python -m benchmark.tools.offline PROPERTIES [N]

MODEL (default /tmp/tiny320) and DTYPE (default float32) in the environment pick another model,
as scripts/gpu_check.sh's ratio check does on a GPU. PROPERTIES is usually
docs/benchmark/cpu-2026-11-26-direct-streams/paged.properties.

Written for the direct-streams run (docs/benchmark/cpu-2026-11-26-direct-streams/): the offline
side of every later served / offline ratio.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from transformers import AutoTokenizer

from benchmark.peer_engine import build_engine, engine_loop
from benchmark.workloads import Lengths, synthetic_jobs

MODEL = Path(os.environ.get("MODEL", "/tmp/tiny320"))
DTYPE = os.environ.get("DTYPE", "float32")
CLIENTS = 32


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.offline",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("properties", type=Path, help="the engine's serving.properties")
    parser.add_argument("n", nargs="?", type=int, default=1280, help="requests (default 1280)")
    args = parser.parse_args()
    properties, n = args.properties, args.n
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
