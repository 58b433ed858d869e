"""Figures from a results folder (sweep.json, and peers.json if present), and `bench plot`.

Figures are built with matplotlib's object API (`Figure`, never pyplot), so nothing needs a
display: PNGs are drawn by Agg whatever the backend, and a notebook with `%matplotlib inline`
shows a returned Figure like any other. Peers are drawn grey and hatched beside the strategies;
a failed entry is a note on the figure, not a missing bar.
"""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from benchmark.goodput_report import GOODPUT_FILE
from benchmark.tables import (
    OTHER_COLORS,
    STRATEGY_COLORS,
    error_line,
    is_peer,
    label,
    load_results,
    percentile,
    results_table,
    samples,
    succeeded,
    summary,
    workload_line,
)

logger = logging.getLogger(__name__)

OVERVIEW_PNG = "benchmark_overview.png"
# The same colour for a strategy in every figure (tables.py); peers are grey and hatched.
PEER_GREYS = ("0.45", "0.6", "0.3", "0.75")
PEER_HATCH = "//"


def _style(name: str, entry: dict, index: int) -> dict:
    if is_peer(entry):
        return {"color": PEER_GREYS[index % len(PEER_GREYS)], "hatch": PEER_HATCH,
                "linestyle": "--"}
    color = STRATEGY_COLORS.get(name, OTHER_COLORS[index % len(OTHER_COLORS)])
    return {"color": color, "hatch": None, "linestyle": "-"}


def _styles(results: dict[str, dict]) -> dict[str, dict]:
    return {name: _style(name, r, i) for i, (name, r) in enumerate(results.items())}


def _note(ax: Axes, missing: list[str]) -> None:
    """Say under the x axis which entries are not drawn (inside the axes it hides bars)."""
    if missing:
        text = textwrap.fill("not shown: " + "; ".join(missing), 90)
        ax.set_xlabel(f"{ax.get_xlabel()}\n{text}".strip(), fontsize=9)


def _kind_legend(ax: Axes, results: dict[str, dict]) -> None:
    if any(is_peer(r) for r in results.values()):
        ax.legend(handles=[Patch(facecolor="tab:blue", label="batchyard strategy"),
                           Patch(facecolor="0.6", hatch=PEER_HATCH, label="peer (other engine)")],
                  fontsize=8, loc="upper left")


def draw_throughput(ax: Axes, results: dict[str, dict], baseline: str = "dynamic") -> None:
    """Requests/s per entry with value labels and the ratio to `baseline`; failures as notes."""
    styles, names = _styles(results), list(results)
    base = results.get(baseline, {})
    base_rps = base["requests_per_s"] if succeeded(base) else 0.0
    top = max((r["requests_per_s"] for r in results.values() if succeeded(r)), default=1.0)
    for x, name in enumerate(names):
        r, style = results[name], styles[name]
        if not succeeded(r):
            ax.text(x, top * 0.02, "failed:\n" + textwrap.fill(error_line(r, 60), 18),
                    ha="center", va="bottom", fontsize=7, color="tab:red")
            continue
        rps = r["requests_per_s"]
        ax.bar(x, rps, color=style["color"], hatch=style["hatch"], edgecolor="white")
        text = f"{rps:.2f}"
        if base_rps > 0 and name != baseline:
            text += f"\n×{rps / base_rps:.2f} {baseline}"
        ax.text(x, rps, text, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [label(n, results[n]) for n in names],
                  rotation=20 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center")
    ax.set_ylim(0, top * 1.3 if top > 0 else 1.0)
    ax.set_ylabel("requests / s (higher is better)")
    ax.set_title("Throughput")
    _kind_legend(ax, results)


def _cdf_points(entry: dict) -> tuple[list[float], list[float], bool]:
    """(seconds, share of requests done by then, exact): every request from the samples, else
    the p50/p90/p99 points that older result files keep."""
    points = sorted(samples(entry, "e2e"))
    if points:
        return points, [(i + 1) / len(points) for i in range(len(points))], True
    known = [(value, share) for p, share in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
             if (value := percentile(entry, "e2e", p)) is not None]
    return [v for v, _ in known], [share for _, share in known], False


def draw_e2e_cdf(ax: Axes, results: dict[str, dict]) -> None:
    """Share of requests answered within t seconds, one line per entry."""
    styles, missing, values = _styles(results), [], []
    for name, r in results.items():
        xs, ys, exact = _cdf_points(r) if succeeded(r) else ([], [], True)
        color, linestyle = styles[name]["color"], styles[name]["linestyle"]
        if not xs:
            missing.append(f"{label(name, r)} ({'no latency data' if succeeded(r) else 'failed'})")
        elif exact:
            ax.step(xs, ys, where="post", label=label(name, r), color=color, linestyle=linestyle)
        else:
            ax.plot(xs, ys, marker="o", linestyle=":", color=color,
                    label=f"{label(name, r)} (p50/p90/p99 only)")
        values += xs
    if values and min(values) > 0 and max(values) / min(values) > 20:
        ax.set_xscale("log")  # `none` answers 10-100x later than the batching strategies
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("share of requests done")
    ax.set_ylim(0, 1.02)
    ax.set_title("End-to-end latency CDF (further left is better)")
    if values:
        ax.legend(fontsize=8, loc="upper left")
    _note(ax, missing)


def draw_percentiles(ax: Axes, results: dict[str, dict], metric: str, title: str,
                     unit: str = "ms") -> None:
    """p50 (solid) and p99 (light) bars of one latency metric per entry."""
    styles, scale = _styles(results), 1000.0 if unit == "ms" else 1.0
    shown, missing, heights = [], [], []
    for name, r in results.items():
        p50, p99 = percentile(r, metric, "p50"), percentile(r, metric, "p99")
        if not succeeded(r) or p50 is None or p99 is None:
            missing.append(f"{label(name, r)} "
                           f"({'failed' if not succeeded(r) else 'not streamed'})")
            continue
        x, style = len(shown), styles[name]
        for offset, value, alpha in ((-0.2, p50, 1.0), (0.2, p99, 0.45)):
            ax.bar(x + offset, value * scale, width=0.4, color=style["color"], alpha=alpha,
                   hatch=style["hatch"], edgecolor="white")
            ax.text(x + offset, value * scale, f"{value * scale:.3g}", ha="center",
                    va="bottom", fontsize=7)
        shown.append(label(name, r))
        heights += [p50 * scale, p99 * scale]
    ax.set_xticks(range(len(shown)), shown, rotation=20 if len(shown) > 4 else 0,
                  ha="right" if len(shown) > 4 else "center")
    if heights and min(heights) > 0 and max(heights) / min(heights) > 50:
        ax.set_yscale("log")  # so the short bars stay readable next to `none`'s queueing
        ax.set_ylim(top=max(heights) * 3)  # room for the value labels
    elif heights:
        ax.set_ylim(0, max(heights) * 1.15)
    ax.set_ylabel(f"{unit} (lower is better)")
    ax.set_title(title)
    ax.legend(handles=[Patch(facecolor="0.35", label="p50"),
                       Patch(facecolor="0.35", alpha=0.45, label="p99")], fontsize=8,
              loc="upper left")
    _note(ax, missing)


def throughput_figure(results: dict[str, dict], baseline: str = "dynamic") -> Figure:
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    draw_throughput(fig.add_subplot(), results, baseline)
    return fig


def e2e_cdf_figure(results: dict[str, dict]) -> Figure:
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    draw_e2e_cdf(fig.add_subplot(), results)
    return fig


def latency_figure(results: dict[str, dict]) -> Figure:
    """Time to first token (s) beside inter-token latency (ms)."""
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ttft, itl = fig.subplots(1, 2)
    draw_percentiles(ttft, results, "ttft", "Time to first token", unit="s")
    draw_percentiles(itl, results, "inter_token", "Inter-token latency")
    return fig


def overview_figure(results: dict[str, dict], baseline: str = "dynamic") -> Figure:
    """All four panels in one picture (the README's)."""
    fig = Figure(figsize=(13, 9), layout="constrained")
    (rps, cdf), (ttft, itl) = fig.subplots(2, 2)
    draw_throughput(rps, results, baseline)
    draw_e2e_cdf(cdf, results)
    draw_percentiles(ttft, results, "ttft", "Time to first token", unit="s")
    draw_percentiles(itl, results, "inter_token", "Inter-token latency")
    line = workload_line(results)
    fig.suptitle("batchyard batching strategies" + (f"\n{line}" if line else ""))
    return fig


def save_figures(results: dict[str, dict], out_dir: Path, baseline: str = "dynamic",
                 dpi: int = 110) -> list[Path]:
    """The overview plus one PNG per figure, written to `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {OVERVIEW_PNG: overview_figure(results, baseline),
               "requests_per_s.png": throughput_figure(results, baseline),
               "e2e_latency_cdf.png": e2e_cdf_figure(results),
               "ttft_inter_token.png": latency_figure(results)}
    paths = []
    for filename, fig in figures.items():
        fig.savefig(out_dir / filename, dpi=dpi)
        paths.append(out_dir / filename)
    return paths


def plot_main(out_dir: Path, baseline: str = "dynamic") -> int:
    """`batchyard bench plot`: figures next to the results, the table on stdout. A `bench
    goodput` run there (goodput.json, or goodput/goodput.json) adds its attainment curve, its
    tables, and a goodput column to the sweep's table; a goodput folder alone is enough."""
    from benchmark.goodput_report import (
        caption,
        find_goodput,
        goodput_by_name,
        report_text,
        save_attainment,
    )

    goodput_dir = find_goodput(out_dir)
    goodput = json.loads((goodput_dir / GOODPUT_FILE).read_text()) if goodput_dir else None
    if goodput is not None and goodput_dir is not None:
        logger.info("wrote %s", save_attainment(goodput, goodput_dir))
        print(f"{caption(goodput)}\n\n{report_text(goodput)}\n")
    try:
        results = load_results(out_dir)
    except (FileNotFoundError, json.JSONDecodeError) as err:
        if goodput is not None and isinstance(err, FileNotFoundError):
            return 0
        logger.error("%s", err)
        return 2
    for path in save_figures(results, out_dir, baseline):
        logger.info("wrote %s", path)
    print(results_table(results, goodput_by_name(goodput) if goodput else None,
                        caption(goodput) if goodput else ""))
    print()
    print(summary(results, baseline))
    return 0


__all__ = ["draw_e2e_cdf", "draw_percentiles", "draw_throughput", "e2e_cdf_figure",
           "latency_figure", "load_results", "overview_figure", "plot_main", "results_table",
           "save_figures", "summary", "throughput_figure", "workload_line"]
