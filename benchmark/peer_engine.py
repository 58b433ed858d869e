"""batchyard's own engine as an offline peer: LLMEngine.step() in-process, no HTTP.

vLLM and transformers run offline in `bench peers`; this runs batchyard the same way, on the
same workload file and protocol (peer_protocol.py), so the table holds a like-for-like row (and
the difference to the served figure is what HTTP streaming costs on that machine).

    python -m benchmark.peer_engine --properties P --model-dir DIR --workload W.json \
        --concurrency C --out R.json [--dtype float32|bfloat16] [--kv-cache-bytes N] \
        [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

from benchmark.peer_protocol import FIRST_TOKENS, closed_loop, warmup_requests

logger = logging.getLogger("peer_engine")
DTYPE_SETTING = {"float32": "fp32", "bfloat16": "bf16"}


def build_engine(properties: Path, model_dir: Path, dtype: str, kv_cache_bytes: int | None,
                 device: str | None = None):
    """The engine the server would build from `properties`, with the peers' dtype, budget and
    device (the transformers peers' device, so both sides share the card or the cores)."""
    from engine import LLMEngine
    from handler.config.properties import Setting, collect_settings
    from handler.config.serving_config import build_serving_config

    settings = collect_settings(properties, {})
    settings["option.dtype"] = Setting(DTYPE_SETTING[dtype], "--dtype")
    if kv_cache_bytes:
        settings["option.kv_cache_memory"] = Setting(str(kv_cache_bytes), "--kv-cache-bytes")
    if device:
        settings["option.device"] = Setting(device, "--device")
    architectures = json.loads((model_dir / "config.json").read_text()).get("architectures", [])
    config = build_serving_config(settings, model_dir, architectures)
    return LLMEngine.from_config(config.engine), config.engine.batching


def engine_loop(engine, requests: list[dict], concurrency: int,
                tag: str) -> tuple[list[dict], list[int]]:
    """Closed loop over LLMEngine.step(), as the other peers run theirs."""
    from engine import SamplingParams

    def add(key: str, r: dict) -> None:
        n = r["new_tokens"]
        engine.add_request(key, r["prompt_ids"],
                           SamplingParams(max_new_tokens=n, min_new_tokens=n, ignore_eos=True))

    def step() -> list[tuple[str, list[int], bool, str]]:
        events = engine.step()
        if not events:  # dynamic batching waiting for its batch to fill
            time.sleep(0.0005)
        return [(e.request_id, [] if e.token_id is None else [e.token_id], e.finished,
                 e.error or "") for e in events]

    return closed_loop(requests, concurrency, tag, add, step)


def pool_tokens(engine) -> dict:
    """The KV pool as built, in tokens: what the hf-cb peer's pool is compared with."""
    allocator = engine.scheduler.allocator
    return {"kv_tokens": allocator.num_blocks * allocator.block_size,
            "kv_block_size": allocator.block_size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", default="batchyard")
    parser.add_argument("--properties", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", choices=tuple(DTYPE_SETTING), default="float32")
    parser.add_argument("--kv-cache-bytes", type=int)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="default: the properties' option.device")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    import torch
    import transformers

    requests = json.loads(args.workload.read_text())["requests"]
    engine, strategy = build_engine(args.properties, args.model_dir, args.dtype,
                                    args.kv_cache_bytes, args.device)
    engine_loop(engine, warmup_requests(requests, args.concurrency), args.concurrency, "w")
    startup = time.perf_counter() - t0
    results, first = engine_loop(engine, requests, args.concurrency, "r")
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    result = {"peer": args.peer, "device": str(engine.runner.device.type), "strategy": strategy,
              "startup_s": startup, "requests": results, "first_tokens": first[:FIRST_TOKENS],
              "versions": versions, "threads": torch.get_num_threads(),
              "kv_cache_bytes": args.kv_cache_bytes, **pool_tokens(engine)}
    args.out.write_text(json.dumps(result))
    errors = sum(not r["ok"] for r in results)
    logger.info("peer %s (%s, pid %d): done, %d errors", args.peer, strategy, os.getpid(), errors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
