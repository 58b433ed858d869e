"""Peak host memory while loading a model folder, one tensor-parallel rank at a time.

Each measurement runs in a fresh interpreter on the CPU, so the peak belongs to that load alone:
the resident set's high-water mark minus the resident set just before loading (torch and the
interpreter). Mapped checkpoint pages count, since they are resident while mapped.
`batchyard bench load-memory` prints the table that README's "Tensor parallelism" cites.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


def measure(model_dir: Path, dtype: str, rank: int, size: int) -> dict:
    """Load rank `rank` of `size` of the folder in a child interpreter; returns its figures."""
    argv = [sys.executable, "-m", "benchmark.load_memory", "--child", str(model_dir), dtype,
            str(rank), str(size)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loading rank {rank} of {size} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _peak_rss() -> int:
    """This process's resident high-water mark. VmHWM, not getrusage's ru_maxrss: that one
    survives exec, so a child forked from a big parent would start at the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status: load-memory needs Linux")


def _child(model_dir: Path, dtype: str, rank: int, size: int) -> dict:
    import time

    import psutil
    import torch

    from engine.models.loader import checkpoint_files, load_model
    from engine.parallel.shard import Shard

    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    model, _ = load_model(model_dir, getattr(torch, dtype), torch.device("cpu"),
                          Shard(rank, size))
    seconds = time.perf_counter() - started
    peak = _peak_rss()
    return {"rank": rank, "size": size, "dtype": dtype, "seconds": round(seconds, 2),
            "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint_files(model_dir)),
            "rank_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "peak_rss_delta_bytes": peak - before}


def add_parser(sub) -> None:
    p = sub.add_parser("load-memory", help="peak host memory of loading each tensor-parallel "
                       "rank of a model folder (CPU)")
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--sizes", default="1,2", help="tensor-parallel degrees, comma-separated")
    p.add_argument("--out", type=Path, help="write load-memory.json here")


def run(args: argparse.Namespace) -> int:
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        row = measure(args.model_dir, args.dtype, 0, size)  # every rank holds the same share
        rows.append(row)
        gib = 2**30
        print(f"degree {size}: rank 0 holds {row['rank_bytes'] / gib:.2f} GiB of a "
              f"{row['checkpoint_bytes'] / gib:.2f} GiB checkpoint; peak host memory while "
              f"loading +{row['peak_rss_delta_bytes'] / gib:.2f} GiB "
              f"({row['peak_rss_delta_bytes'] / row['rank_bytes']:.2f}x its share), "
              f"{row['seconds']:.1f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load-memory.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    folder, kind, rank_text, size_text = sys.argv[2:6]
    print(json.dumps(_child(Path(folder), kind, int(rank_text), int(size_text))))
