"""Run the same load against one server per serving.properties file, one after the other."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmark.loadgen import HTTPTarget, LoadPlan, LoadReport, run_load
from benchmark.servers import ServerStartError, local_server
from benchmark.workloads import Job

logger = logging.getLogger(__name__)

STRATEGY_FILES = ("none", "dynamic", "continuous", "paged")


def default_properties(root: Path) -> list[Path]:
    return [root / f"{name}.properties" for name in STRATEGY_FILES]


def with_overrides(properties: Path, overrides: list[str], out_dir: Path,
                   name: str | None = None) -> Path:
    """A copy of `properties` (out_dir/`name`, default its own name) with `key=value` lines
    appended (a file's later keys win)."""
    if not overrides:
        return properties
    out_dir.mkdir(parents=True, exist_ok=True)
    copy = out_dir / (name or properties.name)
    extra = "\n# set by batchyard bench\n" + "".join(f"{o}\n" for o in overrides)
    copy.write_text(properties.read_text() + extra)
    return copy


def run_sweep(files: list[Path], jobs: list[Job], plan: LoadPlan, out_dir: Path, *,
              warmup: int = 3, overrides: list[str] | None = None,
              model_dir: Path | None = None, stream: bool = True,
              workload: str = "", requests_for: dict[str, int] | None = None
              ) -> dict[str, dict]:
    """Load each strategy in turn; returns {name: report or error}, also written to out_dir.
    `requests_for` gives some strategies another number of requests than `plan`'s."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for path in files:
        name = path.stem
        counts = requests_for or {}
        own_plan = replace(plan, num_requests=counts[name]) if name in counts else plan
        props = with_overrides(path, overrides or [], out_dir)
        logger.info("strategy %s: starting the server with %s", name, props)
        head: dict[str, Any] = {"properties": str(path), "overrides": overrides or [],
                                "workload": workload, "load": own_plan.describe()}
        try:
            with local_server(props, out_dir / f"{name}.server.log", model_dir) as url:
                target = HTTPTarget(url)
                if warmup:
                    run_load(target, jobs[:warmup], LoadPlan(min(warmup, plan.concurrency),
                                                             warmup), stream=stream,
                             progress=False, warmup=True)
                report = run_load(target, jobs, own_plan, stream=stream,
                                  metrics_url=f"{url}/metrics")
            results[name] = {**head, **asdict(report),
                             "kv_workload_concurrency": workload_concurrency(report)}
        except ServerStartError as err:
            logger.error("strategy %s: %s", name, err)
            results[name] = {**head, "error": str(err)}
        except Exception as err:  # noqa: BLE001 - one strategy's failure never ends the sweep
            logger.exception("strategy %s failed", name)
            results[name] = {**head, "error": f"{type(err).__name__}: {err}; log "
                                              f"{out_dir / f'{name}.server.log'}"}
        (out_dir / f"{name}.json").write_text(json.dumps(results[name], indent=2))
        time.sleep(1.0)  # let the port and memory go before the next server
    (out_dir / "sweep.json").write_text(json.dumps(results, indent=2))
    return results


def workload_concurrency(report: LoadReport) -> int:
    """Sequences of this workload's mean length the KV pool holds at once: contiguous
    strategies reserve a max_model_len block per sequence, paged ones only the pages it fills."""
    blocks, block_size = report.server.get("kv_blocks_total"), report.server.get("kv_block_size")
    if not blocks or not block_size:
        return 0
    tokens = report.mean_prompt_tokens + report.mean_output_tokens
    return int(blocks // max(1, math.ceil(tokens / block_size)))
