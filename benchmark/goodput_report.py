"""`bench goodput`'s results as markdown tables and the SLO-attainment figure.

The results dict (goodput.json) holds the SLOs, the load, and per configuration its runs (one
per rate, `slo.rate_summary`) and goodput; these functions read only that, so `bench plot` and
the notebook redraw a saved run without a server. The figure uses matplotlib's object API
(`Figure`, never pyplot) as benchmark/report.py does, in the same colours per strategy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GOODPUT_FILE = "goodput.json"
GOODPUT_PNG = "goodput_attainment.png"
MARKERS = ("o", "s", "^", "D", "v", "P")
RUN_HEAD = ["configuration", "rate (req/s)", "requests (errors)", "SLO attainment", "TTFT met",
            "TPOT met", "TTFT p50 / p90 (ms)", "TPOT p50 / p90 (ms)", "request goodput (req/s)"]


def find_goodput(out_dir: Path) -> Path | None:
    """The folder holding a `bench goodput` run: `out_dir` itself, or its goodput/ (where
    `bench goodput` writes by default, inside the sweep's results folder); None if neither."""
    return next((d for d in (out_dir, out_dir / "goodput") if (d / GOODPUT_FILE).is_file()),
                None)


def load_goodput(out_dir: Path) -> dict | None:
    """The goodput.json `find_goodput` finds, or None."""
    folder = find_goodput(out_dir)
    return json.loads((folder / GOODPUT_FILE).read_text()) if folder else None


def _pct(share: float | None) -> str:
    return "–" if share is None else f"{share:.0%}"


def _pair(run: dict, metric: str) -> str:
    values = [run.get(f"{metric}_p50_ms"), run.get(f"{metric}_p90_ms")]
    return " / ".join("–" if v is None else f"{v:.0f}" for v in values)


def runs_table(results: dict) -> str:
    """One row per configuration and rate, rates ascending; a failed configuration says why."""
    rows = ["| " + " | ".join(RUN_HEAD) + " |", "|---" * len(RUN_HEAD) + "|"]
    for name, config in results["configurations"].items():
        for run in sorted(config.get("runs", []), key=lambda r: r["rate"]):
            rows.append("| " + " | ".join([
                name, f"{run['rate']:g}", f"{run['requests']} ({run['errors']})",
                _pct(run["attainment"]), _pct(run["ttft_met"]), _pct(run["tpot_met"]),
                _pair(run, "ttft"), _pair(run, "tpot"), f"{run['request_goodput']:.3f}"]) + " |")
        if config.get("error"):
            why = str(config["error"]).splitlines()[0][:120].replace("|", "\\|")
            rows.append("| " + " | ".join([name, f"failed: {why}"] + [""] * 7) + " |")
    return "\n".join(rows)


def goodput_table(results: dict) -> str:
    """One row per configuration: its goodput, and the highest passing rate when that differs
    (a non-monotonic curve)."""
    target = results["slo"]["attainment"]
    rows = [f"| configuration | goodput (attainment >= {target:.0%}) | note |", "|---|---|---|"]
    for name, config in results["configurations"].items():
        note = "failed: " + str(config["error"]).splitlines()[0][:80] if config.get(
            "error") else ""
        passing = config.get("highest_passing_rps")
        if passing is not None and passing != config.get("goodput_rps"):
            note = (note + "; " if note else "") + (
                f"non-monotonic: attainment also held at {passing:g} req/s, above a rate "
                "that missed")
        rows.append(f"| {name} | {config.get('goodput', 'not measured')} | "
                    f"{note.replace('|', '/')} |")
    return "\n".join(rows)


def caption(results: dict) -> str:
    slo = results["slo"]
    return (f"`bench goodput`: SLOs TTFT <= {slo['ttft_ms']:g} ms and TPOT <= "
            f"{slo['tpot_ms']:g} ms, attainment target {slo['attainment']:.0%}; "
            f"{results['workload']}; {results['load']}; {results['rates']}. Goodput: the "
            "highest rate at which attainment held there and at every lower rate measured; "
            "a failed request meets neither SLO.")


def report_text(results: dict) -> str:
    return f"{goodput_table(results)}\n\n{runs_table(results)}"


def goodput_by_name(results: dict) -> dict[str, str]:
    """{configuration: goodput in words}, for the sweep table's goodput column."""
    return {name: str(config.get("goodput", "not measured"))
            for name, config in results["configurations"].items()}


def attainment_figure(results: dict) -> Any:
    """SLO attainment (y) against request rate (x), one line per configuration, the target as a
    dashed line, each goodput as a ring."""
    from matplotlib.figure import Figure

    from benchmark.tables import OTHER_COLORS, STRATEGY_COLORS

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    target = results["slo"]["attainment"]
    for i, (name, config) in enumerate(results["configurations"].items()):
        runs = sorted(config.get("runs", []), key=lambda r: r["rate"])
        if not runs:
            continue
        color = STRATEGY_COLORS.get(name, OTHER_COLORS[i % len(OTHER_COLORS)])
        # tied curves overlap: a marker each, and dashes for what is not a batching strategy
        ax.plot([r["rate"] for r in runs], [r["attainment"] for r in runs],
                marker=MARKERS[i % len(MARKERS)], color=color, alpha=0.85,
                linestyle="-" if name in STRATEGY_COLORS else "--",
                label=f"{name}: {config.get('goodput', '')}")
        if config.get("goodput_rps") is not None:
            ax.plot([config["goodput_rps"]], [next(r["attainment"] for r in runs
                                                   if r["rate"] == config["goodput_rps"])],
                    marker="o", markersize=14, fillstyle="none", color=color)
    ax.axhline(target, color="0.4", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    rates = sorted({r["rate"] for c in results["configurations"].values()
                    for r in c.get("runs", [])})
    if rates:  # the measured rates as plain numbers, not powers of two
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
    ax.set_ylim(-0.03, 1.05)
    ax.set_xlabel("request rate (req/s, Poisson arrivals, log scale)")
    ax.set_ylabel("SLO attainment (share of requests)")
    slo = results["slo"]
    ax.set_title(f"SLO attainment: TTFT <= {slo['ttft_ms']:g} ms and TPOT <= "
                 f"{slo['tpot_ms']:g} ms (target {target:.0%}, dashed)")
    ax.legend(fontsize=8, loc="lower left")
    return fig


def save_attainment(results: dict, out_dir: Path, dpi: int = 110) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / GOODPUT_PNG
    attainment_figure(results).savefig(path, dpi=dpi)
    return path
