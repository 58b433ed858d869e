"""The `batchyard bench` commands that benchmark/cli.py parses for: each takes the parsed
arguments and returns the exit status."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from benchmark.loadgen import LoadPlan
from benchmark.options import load_plan, requests_for, size_bytes, workload_jobs
from benchmark.workloads import Job

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmark" / "results" / "sweep"
PEERS = ("hf-static", "hf-cb", "vllm", "vllm-all", "batchyard")
DEFAULT_PEERS = ("hf-static", "hf-cb", "vllm-all")
logger = logging.getLogger(__name__)


def load(args: argparse.Namespace) -> int:
    from benchmark.loadgen import HTTPTarget, SageMakerTarget, run_load, wait_ready

    jobs, described = workload_jobs(args, args.model_dir)
    plan = load_plan(args)
    if args.endpoint:
        target = SageMakerTarget(args.endpoint, args.region, args.endpoint_url,
                                 max_connections=args.concurrency + 4)
        metrics_url = None
    else:
        try:
            wait_ready(args.url, args.ready_timeout)
        except TimeoutError as err:
            print(f"batchyard bench: {err}", file=sys.stderr)
            return 2
        target, metrics_url = HTTPTarget(args.url), f"{args.url.rstrip('/')}/metrics"
    stream = not args.no_stream
    logger.info("workload: %s; %s", described, plan.describe())
    if args.warmup:
        run_load(target, jobs[:args.warmup], LoadPlan(args.warmup, args.warmup),
                 stream=stream, progress=False, warmup=True)
    report = run_load(target, jobs, plan, stream=stream, metrics_url=metrics_url)
    print(report.table())
    if args.json:
        args.json.write_text(report.to_json())
    return 1 if report.num_errors else 0


def sweep(args: argparse.Namespace) -> int:
    from benchmark.sweep import default_properties, run_sweep
    from benchmark.tables import results_table

    names = _peer_names([n for n in args.peers.split(",") if n], "--peers")
    if names:
        _check_peer_plan(args)
    files = args.properties or default_properties(ROOT / "serving.properties.d")
    per_strategy = requests_for(args.requests_for, [f.stem for f in files])
    if args.kv_cache_memory:
        size_bytes(args.kv_cache_memory, "--kv-cache-memory")
    overrides = args.set + ([f"option.kv_cache_memory={args.kv_cache_memory}"]
                            if args.kv_cache_memory else [])
    jobs, described = workload_jobs(args, args.model_dir)
    plan = load_plan(args)
    logger.info("workload: %s; %s", described, plan.describe())
    results = run_sweep(files, jobs, plan, args.out, warmup=args.warmup, overrides=overrides,
                        model_dir=args.model_dir, stream=not args.no_stream, workload=described,
                        requests_for=per_strategy)
    print(results_table(results))
    failed = any("error" in r or r["num_errors"] for r in results.values())
    if names:
        failed = _run_peers(args, names, jobs) or failed
    print(f"results: {args.out} (figures: batchyard bench plot --out {args.out})")
    return 1 if failed else 0


def peers(args: argparse.Namespace) -> int:
    names = _peer_names(args.names or list(DEFAULT_PEERS), "peers")
    _check_peer_plan(args)
    jobs, described = workload_jobs(args, args.model_dir)
    logger.info("workload: %s", described)
    return 1 if _run_peers(args, names, jobs) else 0


def _peer_names(names: list[str], what: str) -> list[str]:
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise ValueError(f"{what}: unknown {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    return names


def _check_peer_plan(args: argparse.Namespace) -> None:
    """Before anything runs: peers only know a closed loop of N requests."""
    if args.duration is not None or args.rate is not None:
        raise ValueError("peers run a closed loop of --requests: drop --duration / --rate")


def _run_peers(args: argparse.Namespace, names: list[str], jobs: list[Job]) -> bool:
    """Runs the peers; True when one of them failed (each says why in the table)."""
    from benchmark.peers import ENGINE_PROPERTIES, install_vllm, run_peers
    from benchmark.sweep import with_overrides
    from benchmark.tables import results_table
    from handler.model_source.default_model import ensure_default_model

    python = args.vllm_venv / "bin" / "python"
    unavailable = {}
    if args.install_vllm and any(n.startswith("vllm") for n in names) and not python.exists():
        try:
            install_vllm(args.vllm_venv)
        except RuntimeError as err:  # the vLLM rows say why; the other peers still run
            unavailable = {n: str(err) for n in names if n.startswith("vllm")}
    plan = load_plan(args)
    work = [jobs[i % len(jobs)] for i in range(plan.num_requests or 0)]
    kv_bytes = (size_bytes(args.kv_cache_memory, "--kv-cache-memory")
                if args.kv_cache_memory else None)
    engine_properties = with_overrides(args.engine_properties or ENGINE_PROPERTIES,
                                       getattr(args, "set", []), args.out,
                                       "batchyard-peer.properties")
    results = run_peers(names, work, plan.concurrency, args.model_dir or ensure_default_model(),
                        args.out, args.dtype, python, kv_cache_bytes=kv_bytes,
                        unavailable=unavailable, device=args.peer_device,
                        engine_properties=engine_properties)
    print(results_table(results))
    return any("error" in r or r["num_errors"] for r in results.values())


def plot(args: argparse.Namespace) -> int:
    try:
        from benchmark.report import plot_main
    except ImportError as err:  # matplotlib is an extra, not in the serving image
        print(f"batchyard bench plot: {err.name or err} is not installed; "
              "pip install -e '.[notebook]'", file=sys.stderr)
        return 2
    return plot_main(args.out)


def stall(args: argparse.Namespace) -> int:
    from benchmark.servers import local_server
    from benchmark.stall import long_prompt, run_stall
    from handler.model_source.default_model import ensure_default_model

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


def decode(args: argparse.Namespace) -> int:
    from benchmark.decode import run_decode
    from handler.model_source.default_model import ensure_default_model

    report = run_decode(args.model_dir or ensure_default_model(), args.new_tokens, args.dtype)
    print(f"batch-1 decode, {report.new_tokens} tokens, {args.dtype}: batchyard "
          f"{report.batchyard_tokens_per_s:.1f} tok/s, transformers generate "
          f"{report.transformers_tokens_per_s:.1f} tok/s (x{report.ratio:.2f}); "
          f"same tokens: {report.same_tokens}")
    return 0 if report.same_tokens else 1


def profile(args: argparse.Namespace) -> int:
    from benchmark.profile import run_profile
    from handler.model_source.default_model import ensure_default_model

    sizes = [int(n) for n in args.batch_sizes.split(",") if n.strip()]
    if not sizes or min(sizes) < 1 or args.steps < 1 or args.warmup < 0:
        raise ValueError("--batch-sizes must list integers >= 1, --steps must be >= 1 and "
                         "--warmup >= 0")
    if args.prompt_tokens is not None and args.prompt_tokens < 2:
        raise ValueError(f"--prompt-tokens must be >= 2, got {args.prompt_tokens}")
    if args.hbm_bandwidth is not None and not args.hbm_bandwidth > 0:
        raise ValueError(f"--hbm-bandwidth must be > 0 (TB/s), got {args.hbm_bandwidth}")
    run = run_profile(args.model_dir or ensure_default_model(), sizes, args.steps, args.warmup,
                      args.strategy, args.dtype, args.device,
                      tensor_parallel=args.tensor_parallel,
                      async_scheduling={"auto": None, "true": True, "false": False}[
                          args.async_scheduling],
                      prompt_tokens=args.prompt_tokens, enforce_eager=args.enforce_eager,
                      attention_backend=args.attention_backend,
                      hbm_bandwidth=None if args.hbm_bandwidth is None
                      else args.hbm_bandwidth * 1e12)
    print(run.table())
    if args.out:
        run.save(args.out)
    return 0


def random_model(args: argparse.Namespace) -> int:
    from benchmark.random_model import build_random_llama
    from handler.model_source.default_model import ensure_default_model

    num_params = build_random_llama(args.out, args.tokenizer_from or ensure_default_model(),
                                    args.preset, args.dtype, args.device, args.seed)
    print(f"{args.out}: {args.preset}, {num_params / 1e9:.3f} B parameters, {args.dtype}")
    return 0
