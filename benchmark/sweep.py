"""Run the same load against one server per serving.properties file, one after the other."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from benchmark.loadgen import HTTPTarget, LoadReport, run_load
from benchmark.servers import ServerStartError, local_server
from benchmark.workloads import Job

logger = logging.getLogger(__name__)

STRATEGY_FILES = ("none", "dynamic", "continuous", "paged")


def default_properties(root: Path) -> list[Path]:
    return [root / f"{name}.properties" for name in STRATEGY_FILES]


def with_overrides(properties: Path, overrides: list[str], out_dir: Path) -> Path:
    """A copy of `properties` with `key=value` lines appended (a file's later keys win)."""
    if not overrides:
        return properties
    copy = out_dir / properties.name
    extra = "\n# set by batchyard bench\n" + "".join(f"{o}\n" for o in overrides)
    copy.write_text(properties.read_text() + extra)
    return copy


def run_sweep(files: list[Path], jobs: Callable[[], list[Job]], concurrency: int,
              out_dir: Path, warmup: int = 3, overrides: list[str] | None = None,
              model_dir: Path | None = None, stream: bool = True) -> dict[str, dict]:
    """Load each strategy in turn; returns {name: report or error}, also written to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for path in files:
        name = path.stem
        props = with_overrides(path, overrides or [], out_dir)
        logger.info("strategy %s: starting the server with %s", name, props)
        try:
            with local_server(props, out_dir / f"{name}.server.log", model_dir) as url:
                target = HTTPTarget(url)
                if warmup:
                    run_load(target, jobs()[:warmup], min(warmup, concurrency), stream,
                             progress=False)
                report = run_load(target, jobs(), concurrency, stream, f"{url}/metrics")
            results[name] = {"properties": str(path), "overrides": overrides or [],
                             **asdict(report)}
        except ServerStartError as err:
            logger.error("strategy %s: %s", name, err)
            results[name] = {"properties": str(path), "error": str(err)}
        (out_dir / f"{name}.json").write_text(json.dumps(results[name], indent=2))
        time.sleep(1.0)  # let the port and memory go before the next server
    (out_dir / "sweep.json").write_text(json.dumps(results, indent=2))
    return results


def sweep_table(results: dict[str, dict]) -> str:
    """One row per strategy: throughput, latency percentiles and server-side step facts."""
    head = (f"{'strategy':<18}{'req/s':>8}{'tok/s':>9}{'TTFT p50':>10}{'ITL p50':>9}"
            f"{'ITL p99':>9}{'e2e p50':>9}{'e2e p99':>9}{'batch':>7}{'KV max':>8}{'errors':>8}")
    rows = [head]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"{name:<18}  failed: {r['error'].splitlines()[0]}")
            continue
        rep = LoadReport(**{k: r[k] for k in LoadReport.__dataclass_fields__})
        ms = lambda d, p: d.get(p, float("nan")) * 1000  # noqa: E731
        rows.append(
            f"{name:<18}{rep.requests_per_s:>8.3f}{rep.output_tokens_per_s:>9.1f}"
            f"{ms(rep.ttft, 'p50'):>10.0f}{ms(rep.inter_token, 'p50'):>9.0f}"
            f"{ms(rep.inter_token, 'p99'):>9.0f}{ms(rep.e2e, 'p50'):>9.0f}"
            f"{ms(rep.e2e, 'p99'):>9.0f}{rep.server.get('mean_batch_size', 0):>7.1f}"
            f"{rep.server.get('kv_max_concurrency', 0):>8.0f}{rep.num_errors:>8d}")
    return "\n".join(rows)
