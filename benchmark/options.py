"""Command-line options shared by `bench load`, `sweep` and `peers`: the workload and the plan."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from benchmark.loadgen import LoadPlan
from benchmark.workloads import Job, Lengths, jsonl_jobs, lmi_jobs, synthetic_jobs

logger = logging.getLogger(__name__)


def add_load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--concurrency", type=int, default=32,
                   help="clients in the closed loop, or the cap on requests in flight with --rate")
    p.add_argument("-n", "--requests", type=int, help="total requests (default 96 without "
                   "--duration)")
    p.add_argument("--duration", type=float, metavar="SECONDS",
                   help="stop sending new requests after this long")
    p.add_argument("--rate", type=float, metavar="REQ_PER_S",
                   help="Poisson arrivals at this rate instead of a closed loop")
    p.add_argument("--seed", type=int, default=0, help="synthetic lengths and arrivals")
    p.add_argument("--warmup", type=int, default=3, help="requests sent first, not counted")
    p.add_argument("--no-stream", action="store_true",
                   help="non-streaming requests (no TTFT / inter-token figures)")
    p.add_argument("--workload", default="lmi", metavar="lmi|synthetic|FILE.jsonl",
                   help="the LMI study's three prompts (64/256/128 new tokens), random prompts "
                   "of --prompt-tokens with --output-tokens, or one JSON object per line with "
                   "the prompt under inputs/prompt/text and optional max_new_tokens")
    p.add_argument("--prompt-tokens", default="uniform:32:512", metavar="DIST",
                   help="synthetic prompt lengths: N, uniform:LO:HI or normal:MEAN:STD")
    p.add_argument("--output-tokens", default="uniform:32:256", metavar="DIST",
                   help="output lengths of synthetic prompts and of JSONL lines without "
                   "max_new_tokens")


def load_plan(args: argparse.Namespace) -> LoadPlan:
    requests = args.requests if args.requests is not None or args.duration is not None else 96
    return LoadPlan(args.concurrency, requests, args.duration, args.rate, args.seed)


def requests_for(values: list[str], strategies: list[str]) -> dict[str, int]:
    """`--requests-for none=32 …` as {strategy: requests}, each name one of `strategies`."""
    counts: dict[str, int] = {}
    for value in values:
        name, _, count = value.partition("=")
        if name not in strategies:
            raise ValueError(f"--requests-for: {name!r} is not a strategy of this sweep "
                             f"({', '.join(strategies)})")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--requests-for: {value!r} needs a whole number of requests >= 1, "
                             "e.g. none=32")
        counts[name] = int(count)
    return counts


def workload_jobs(args: argparse.Namespace, model_dir: Path | None) -> tuple[list[Job], str]:
    """The jobs (cycled by the load generator) and a one-line description of them."""
    outputs = Lengths.parse(args.output_tokens, "--output-tokens")
    count = max(args.requests or 0, args.warmup, 1) if args.duration is None else 1000
    if args.workload == "lmi":
        return lmi_jobs(3), "LMI study: 3 prompts, exactly 64/256/128 new tokens (EOS ignored)"
    if args.workload == "synthetic":
        prompts = Lengths.parse(args.prompt_tokens, "--prompt-tokens")
        tokenizer = _tokenizer(model_dir)
        jobs = synthetic_jobs(count, prompts, outputs, args.seed, tokenizer)
        exact = "" if tokenizer is not None else " (approximate: no tokenizer)"
        return jobs, (f"synthetic: prompts of {prompts} tokens{exact}, exactly {outputs} new "
                      f"tokens (EOS ignored), seed {args.seed}")
    path = Path(args.workload)
    if not path.is_file():
        raise ValueError(f"--workload: {args.workload!r} is not lmi, synthetic or a JSONL file")
    jobs = jsonl_jobs(path, count, outputs, args.seed)
    return jobs, f"{path.name}: {len(set(jobs))} prompts, new tokens as given or {outputs}"


def size_bytes(text: str, what: str) -> int:
    """`720MiB`, `2GiB`, `4096`… as bytes (the units serving.properties accepts)."""
    from handler.config.reader import parse_size

    size = parse_size(text)
    if size is None:
        raise ValueError(f"{what}: expected a size such as 720MiB or 2GiB, got {text!r}")
    return size


def _tokenizer(model_dir: Path | None):  # noqa: ANN202 - a transformers tokenizer
    """The model's tokenizer makes synthetic prompt lengths exact (the embedded default
    model's when no folder is given and it is on disk)."""
    from handler.model_source.default_model import default_model_dir

    folder = model_dir or default_model_dir()
    if not (folder / "tokenizer_config.json").is_file():
        logger.warning("no tokenizer in %s: synthetic prompt lengths are approximate", folder)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
