"""`batchyard bench …`: load, sweep, stall and decode benchmarks (figures, not tests)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from benchmark.workloads import lmi_jobs

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchyard bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    load = sub.add_parser("load", help="closed-loop load against a running server")
    load.add_argument("--url", default="http://127.0.0.1:8080")
    load.add_argument("--json", type=Path, help="also write the report here")
    load.add_argument("--ready-timeout", type=float, default=600.0,
                      help="seconds to wait for /ping to answer 200")
    _load_options(load)

    sweep = sub.add_parser("sweep", help="start one server per properties file and load each")
    sweep.add_argument("properties", nargs="*", type=Path,
                       help="default: none, dynamic, continuous, paged from serving.properties.d")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="append to every properties file, e.g. option.kv_cache_memory=720MiB")
    sweep.add_argument("--model-dir", type=Path)
    sweep.add_argument("--out", type=Path, default=ROOT / "benchmark" / "results" / "sweep")
    _load_options(sweep)

    stall = sub.add_parser("stall", help="decode stalls while a long prompt arrives")
    stall.add_argument("properties", nargs="+", type=Path, help="one server per file, in turn")
    stall.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    stall.add_argument("--decoders", type=int, default=8)
    stall.add_argument("--decode-tokens", type=int, default=64)
    stall.add_argument("--long-prompt-tokens", type=int, default=2000)
    stall.add_argument("--out", type=Path, default=ROOT / "benchmark" / "results" / "stall")

    decode = sub.add_parser("decode", help="batch-1 decode tokens/s vs transformers generate")
    decode.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    decode.add_argument("--new-tokens", type=int, default=128)
    decode.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return {"load": _load, "sweep": _sweep, "stall": _stall, "decode": _decode}[args.command](args)


def _load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--concurrency", type=int, default=32)
    p.add_argument("-n", "--requests", type=int, default=96, help="total requests")
    p.add_argument("--warmup", type=int, default=3, help="requests sent first, not counted")
    p.add_argument("--no-stream", action="store_true",
                   help="non-streaming requests (no TTFT / inter-token figures)")


def _load(args: argparse.Namespace) -> int:
    from benchmark.loadgen import HTTPTarget, run_load, wait_ready

    try:
        wait_ready(args.url, args.ready_timeout)
    except TimeoutError as err:
        print(f"batchyard bench: {err}", file=sys.stderr)
        return 2
    target = HTTPTarget(args.url)
    stream = not args.no_stream
    if args.warmup:
        run_load(target, lmi_jobs(args.warmup), args.warmup, stream, progress=False)
    report = run_load(target, lmi_jobs(args.requests), args.concurrency, stream,
                      f"{args.url.rstrip('/')}/metrics")
    print(report.table())
    if args.json:
        args.json.write_text(report.to_json())
    return 1 if report.num_errors else 0


def _sweep(args: argparse.Namespace) -> int:
    from benchmark.sweep import default_properties, run_sweep, sweep_table

    files = args.properties or default_properties(ROOT / "serving.properties.d")
    results = run_sweep(files, lambda: lmi_jobs(args.requests), args.concurrency, args.out,
                        args.warmup, args.set, args.model_dir, not args.no_stream)
    print(sweep_table(results))
    print(f"results: {args.out}")
    return 1 if any("error" in r or r["num_errors"] for r in results.values()) else 0


def _stall(args: argparse.Namespace) -> int:
    from benchmark.servers import local_server
    from benchmark.stall import long_prompt, run_stall
    from handler.default_model import ensure_default_model

    model_dir = args.model_dir or ensure_default_model()
    prompt = long_prompt(model_dir, args.long_prompt_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for props in args.properties:
        with local_server(props, args.out / f"{props.stem}.server.log", args.model_dir) as url:
            reports[props.stem] = report = run_stall(url, prompt, args.decoders,
                                                     args.decode_tokens)
        itl = {k: f"{v * 1000:.0f} ms" for k, v in report.inter_token.items()}
        print(f"{props.stem}: long prompt of {report.long_prompt_tokens} tokens answered in "
              f"{report.long_prompt_latency_s:.2f} s; inter-token latency of the "
              f"{report.num_decoders} running requests p50 {itl.get('p50', '-')}, p99 "
              f"{itl.get('p99', '-')}, max {report.max_inter_token_s * 1000:.0f} ms; "
              f"errors {report.errors}")
    (args.out / "stall.json").write_text(json.dumps({k: asdict(v) for k, v in reports.items()},
                                                    indent=2))
    return 1 if any(r.errors for r in reports.values()) else 0


def _decode(args: argparse.Namespace) -> int:
    from benchmark.decode import run_decode
    from handler.default_model import ensure_default_model

    report = run_decode(args.model_dir or ensure_default_model(), args.new_tokens, args.dtype)
    print(f"batch-1 decode, {report.new_tokens} tokens, {args.dtype}: batchyard "
          f"{report.batchyard_tokens_per_s:.1f} tok/s, transformers generate "
          f"{report.transformers_tokens_per_s:.1f} tok/s (x{report.ratio:.2f}); "
          f"same tokens: {report.same_tokens}")
    return 0 if report.same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
