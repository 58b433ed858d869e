"""Time to first token of one long prompt: colocated, prefilled by one disaggregated worker, and
shared by two or more (KV-Runahead). `bench runahead` starts each configuration's engine (its
workers on their shares of this host's cores), sends --repeats prompts of --prompt-tokens
distinct random tokens one at a time, and reports TTFT per configuration, its ratio to one
prefill worker, and how the prompt was split. Figures, not tests."""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from pathlib import Path

from benchmark.tables import write_report

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("runahead", help="TTFT of one long prompt: colocated, one prefill "
                       "worker, and prefill workers sharing it (KV-Runahead)")
    p.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3, help="prompts per configuration")
    p.add_argument("--workers", default="1,2",
                   help="prefill worker counts, comma-separated (default 1,2)")
    p.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the colocated paged engine on every core")
    p.add_argument("--even-split", action=argparse.BooleanOptionalAction, default=True,
                   help="also time shared prompts cut into equal slices (the partition rule "
                   "against no rule)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, help="write runahead.json and runahead.md here")


EVEN = 1e12  # the partition's r when attention costs nothing: equal slices


def _config(args: argparse.Namespace, model_dir: Path, prefill_workers: int | None,
            r: float | None = None):
    from engine import Disaggregation, EngineConfig

    plan = None if prefill_workers is None else Disaggregation(
        num_prefill_workers=prefill_workers, cooperative_prefill_threshold=2,
        partition_linear_tokens=r)
    return EngineConfig(model=str(model_dir), batching="paged", max_num_seqs=4,
                        dtype=args.dtype, device=args.device,
                        max_model_len=args.prompt_tokens + 8, disaggregation=plan)


def _ttfts(config, prompts: list[list[int]]) -> list[float]:
    """Seconds to the first token of each prompt, sent one at a time (after one warm-up)."""
    from engine import EngineClient, GenerationRequest, SamplingParams

    client = EngineClient.from_config(config, 10, process=True)
    client.start()
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    try:
        times = []
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            handle = client.submit(GenerationRequest(tuple(prompt), params))
            first = next(handle.events())
            elapsed = time.perf_counter() - start
            list(handle.events())
            assert first.token_id is not None, first
            if i:  # the first one warms up
                times.append(elapsed)
        return times
    finally:
        client.shutdown(5)


def run(args: argparse.Namespace) -> int:
    from engine.disagg.partition import linear_tokens, partition
    from engine.model_files import read_json_object
    from handler.model_source.default_model import ensure_default_model

    model_dir = args.model_dir or ensure_default_model()
    counts = [int(c) for c in args.workers.split(",")]
    if args.prompt_tokens < 2 or args.repeats < 1 or min(counts) < 1:
        raise ValueError("--prompt-tokens >= 2, --repeats and --workers >= 1")
    rng = random.Random(0)
    vocab = read_json_object(model_dir / "config.json").get("vocab_size", 32000)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
               for _ in range(args.repeats + 1)]
    r = linear_tokens(read_json_object(model_dir / "config.json"))
    rows: dict[str, dict] = {}
    runs: list[tuple[str, int | None, float]] = [("colocated paged", None, r)] \
        if args.colocated else []
    runs += [(f"{n} prefill worker{'s' if n > 1 else ''} + 1 decode", n, r) for n in counts]
    if args.even_split:
        runs += [(f"{n} prefill workers + 1 decode, equal slices", n, EVEN)
                 for n in counts if n > 1]
    for name, workers, split in runs:
        logger.info("%s: %d prompts of %d tokens", name, args.repeats, args.prompt_tokens)
        times = _ttfts(_config(args, model_dir, workers, split), prompts)
        starts = partition(args.prompt_tokens, workers or 1, split)
        slices = [b - a for a, b in zip(starts, [*starts[1:], args.prompt_tokens], strict=True)]
        rows[name] = {"prefill_workers": workers, "ttft_s": times,
                      "ttft_median_s": statistics.median(times), "slices": slices}
    base = next((row["ttft_median_s"] for row in rows.values()
                 if row["prefill_workers"] == 1), None)
    lines = ["| configuration | TTFT median (s) | runs (s) | vs 1 prefill worker | slices |",
             "|---|---|---|---|---|"]
    for name, row in rows.items():
        ratio = f"{base / row['ttft_median_s']:.2f}x" if base else "-"
        lines.append(f"| {name} | {row['ttft_median_s']:.3f} | "
                     f"{', '.join(f'{t:.3f}' for t in row['ttft_s'])} | {ratio} | "
                     f"{' + '.join(map(str, row['slices'])) if row['prefill_workers'] else '-'} |")
    caption = (f"TTFT of one {args.prompt_tokens}-token prompt ({model_dir.name}, {args.device}, "
               f"{args.repeats} prompts after a warm-up; r = {r:.0f} tokens)")
    write_report(args.out, "runahead", {"r": r, "rows": rows}, caption, "\n".join(lines))
    return 0
