"""`batchyard bench goodput`: DistServe's goodput per serving configuration. One server per
properties file (as `bench sweep` starts them), then open-loop Poisson arrivals at a sweep of
request rates (`--rates`) or a search (double from `--start-rate` until SLO attainment falls
below the target, then bisect), streaming so every request's TTFT and TPOT are measured. Reports
per rate the SLO attainment, each SLO's share, TTFT/TPOT p50/p90 and vLLM's request goodput, and
per configuration the goodput (benchmark/slo.py says exactly how); writes goodput.json,
goodput.md and the attainment curve (goodput_attainment.png). Figures, not tests."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path

from benchmark.goodput_report import caption, report_text, save_attainment
from benchmark.loadgen import LoadPlan, RequestResult, run_load
from benchmark.options import workload_jobs
from benchmark.servers import ServerStartError, local_server
from benchmark.slo import SLO, goodput, goodput_text, highest_passing, rate_summary, search_rates
from benchmark.sweep import STRATEGY_FILES, with_overrides
from benchmark.tables import write_report
from benchmark.targets import HTTPTarget, Target
from benchmark.workloads import Job

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
DISAGGREGATED = "disaggregated"


def add_parser(sub) -> None:
    p = sub.add_parser("goodput", help="SLO attainment vs Poisson request rate per "
                       "configuration, and its goodput (DistServe)")
    p.add_argument("--properties", nargs="+", type=Path, help="one server per file (default: "
                   "none, dynamic, continuous, paged and, if present, disaggregated from "
                   "serving.properties.d)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="append to every properties file, e.g. option.max_model_len=1024")
    p.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    p.add_argument("--ttft-slo", type=float, default=2000.0, metavar="MS",
                   help="time to first token SLO in ms (default 2000)")
    p.add_argument("--tpot-slo", type=float, default=200.0, metavar="MS",
                   help="time per output token SLO in ms, per request mean (default 200)")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet both SLOs (default 0.9)")
    p.add_argument("--rates", help="request rates to measure, comma-separated (req/s); "
                   "default: search from --start-rate")
    p.add_argument("--start-rate", type=float, default=0.5, help="the search's first rate")
    p.add_argument("--max-rate", type=float, default=64.0, help="the search doubles up to this")
    p.add_argument("--bisect", type=int, default=2, help="bisection steps after the crossing")
    p.add_argument("--stop-below", type=float, default=0.5, metavar="SHARE",
                   help="with --rates: skip a configuration's higher rates once its attainment "
                   "falls below this (default 0.5; 0 measures every rate)")
    p.add_argument("--requests", type=int, help="requests per rate (default 32 without "
                   "--duration)")
    p.add_argument("--duration", type=float, metavar="SECONDS",
                   help="stop sending at each rate after this long (then wait for answers)")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="client threads: requests in flight at once (later ones wait, and the "
                   "wait counts in their TTFT)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first, not counted")
    p.add_argument("--seed", type=int, default=0, help="synthetic lengths and arrivals")
    p.add_argument("--workload", default="synthetic", metavar="lmi|synthetic|FILE.jsonl",
                   help="as `bench load` (default synthetic: long prompts meet decodes)")
    p.add_argument("--prompt-tokens", default="uniform:128:1024", metavar="DIST",
                   help="synthetic prompt lengths: N, uniform:LO:HI or normal:MEAN:STD")
    p.add_argument("--output-tokens", default="uniform:16:128", metavar="DIST",
                   help="synthetic output lengths")
    p.add_argument("--out", type=Path, default=ROOT / "benchmark" / "results" / "sweep" / "goodput",
                   help="default: goodput/ in the sweep's results folder, where `bench plot` "
                   "and the notebook find it")


def default_files(root: Path) -> list[Path]:
    """The four strategies, plus disaggregated prefill/decode when its file ships."""
    files = [root / f"{name}.properties" for name in STRATEGY_FILES]
    extra = root / f"{DISAGGREGATED}.properties"
    return files + ([extra] if extra.is_file() else [])


def parse_rates(text: str) -> list[float]:
    try:
        rates = sorted({float(r) for r in text.split(",") if r.strip()})
    except ValueError:
        rates = []
    if not rates or rates[0] <= 0:
        raise ValueError(f"--rates: expected positive req/s, comma-separated, got {text!r}")
    return rates


class Recorder:
    """A Target that keeps every RequestResult it returns: run_load summarizes percentiles,
    but SLO attainment needs each request's own TTFT and TPOT together."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.results: list[RequestResult] = []

    def send(self, job: Job, *, stream: bool, start: float | None = None,
             on_token: Callable[[int], None] | None = None) -> RequestResult:
        begun = time.perf_counter() if start is None else start
        try:
            result = self.target.send(job, stream=stream, start=begun, on_token=on_token)
        except Exception as err:  # noqa: BLE001 - a failed request, as run_load counts it
            result = RequestResult(ok=False, start=begun, end=time.perf_counter(),
                                   error=f"{type(err).__name__}: {err}"[:200])
        self.results.append(result)
        return result


def measure_rate(target: Target, jobs: list[Job], rate: float, slo: SLO,
                 args: argparse.Namespace) -> dict:
    """One open-loop run at `rate`, summarized against the SLOs."""
    recorder = Recorder(target)
    plan = LoadPlan(args.max_in_flight, args.requests, args.duration, rate, args.seed)
    report = run_load(recorder, jobs, plan, stream=True, progress=False)
    run = rate_summary(rate, recorder.results, report.duration_s, slo)
    logger.info("rate %g req/s: attainment %.0f%% (TTFT met %.0f%%, TPOT met %.0f%%), %d "
                "requests, %d errors", rate, 100 * run["attainment"], 100 * run["ttft_met"],
                100 * run["tpot_met"], run["requests"], run["errors"])
    return run


def measure_config(path: Path, jobs: list[Job], slo: SLO, args: argparse.Namespace) -> dict:
    """Start the configuration's server, warm it, measure its rates; an error is kept with the
    runs measured before it."""
    name = path.stem
    props = with_overrides(path, args.set, args.out, f"{name}.goodput.properties")
    entry: dict = {"properties": str(path), "overrides": args.set, "runs": []}
    runs: list[dict] = entry["runs"]
    try:
        with local_server(props, args.out / f"{name}.goodput.server.log", args.model_dir) as url:
            target = HTTPTarget(url)
            if args.warmup:
                run_load(target, jobs[:args.warmup], LoadPlan(args.warmup, args.warmup),
                         progress=False, warmup=True)

            def attained(rate: float) -> float:
                runs.append(measure_rate(target, jobs, rate, slo, args))
                return runs[-1]["attainment"]

            if args.rates:
                for rate in parse_rates(args.rates):
                    if attained(rate) < args.stop_below:
                        break  # higher rates only queue more: skipped, said in the report
            else:
                search_rates(attained, slo.attainment, start=args.start_rate,
                             max_rate=args.max_rate, bisect_steps=args.bisect)
    except ServerStartError as err:
        entry["error"] = str(err)
    except Exception as err:  # noqa: BLE001 - one configuration's failure never ends the run
        logger.exception("configuration %s failed", name)
        entry["error"] = f"{type(err).__name__}: {err}"
    points = [(r["rate"], r["attainment"]) for r in runs]
    entry["goodput_rps"] = goodput(points, slo.attainment)
    entry["highest_passing_rps"] = highest_passing(points, slo.attainment)
    entry["goodput"] = goodput_text(entry["goodput_rps"], points)
    return entry


def load_text(args: argparse.Namespace) -> str:
    stop = [f"{args.requests} requests"] if args.requests is not None else []
    stop += [f"{args.duration:g} s"] if args.duration is not None else []
    skip = (f"; higher rates skipped once attainment < {args.stop_below:.0%}"
            if args.rates and args.stop_below > 0 else "")
    return (f"Poisson arrivals (seed {args.seed}), at most {args.max_in_flight} in flight, "
            f"{' or '.join(stop)} per rate, streamed, after {args.warmup} warm-up requests"
            + skip)


def run(args: argparse.Namespace) -> int:
    from handler.model_source.default_model import ensure_default_model

    slo = SLO(args.ttft_slo / 1000, args.tpot_slo / 1000, args.attainment)
    if args.rates:
        parse_rates(args.rates)  # a bad list fails before any server starts
    if args.requests is None and args.duration is None:
        args.requests = 32
    files = args.properties or default_files(ROOT / "serving.properties.d")
    jobs, described = workload_jobs(args, args.model_dir or ensure_default_model())
    results: dict = {
        "slo": {"ttft_ms": args.ttft_slo, "tpot_ms": args.tpot_slo,
                "attainment": args.attainment},
        "workload": described,
        "load": load_text(args),
        "rates": f"rates {args.rates}" if args.rates else (
            f"search: from {args.start_rate:g} req/s doubling to at most {args.max_rate:g}, "
            f"then {args.bisect} bisection steps"),
        "configurations": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for path in files:
        logger.info("configuration %s: %s", path.stem, path)
        results["configurations"][path.stem] = measure_config(path, jobs, slo, args)
        time.sleep(1.0)  # let the port and memory go before the next server
    write_report(args.out, "goodput", results, caption(results), report_text(results))
    try:
        logger.info("wrote %s", save_attainment(results, args.out))
    except ImportError as err:  # matplotlib is an extra, not in the serving image
        logger.warning("no figure: %s (pip install -e '.[notebook]')", err)
    return 1 if any("error" in c for c in results["configurations"].values()) else 0
