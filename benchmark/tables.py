"""What a results folder holds (sweep.json, and peers.json if present), as a table and in words.

Reads only the JSON that `batchyard bench sweep` and `batchyard bench peers` write, so it runs
without torch or a server, and copes with older files (no per-request samples, no workload).
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path

# The same colour for a strategy in every figure (report.py, goodput_report.py).
STRATEGY_COLORS = {"none": "tab:red", "dynamic": "tab:orange", "continuous": "tab:blue",
                   "paged": "tab:green"}
OTHER_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")

SWEEP_FILE = "sweep.json"
PEERS_FILE = "peers.json"
# Run-to-run drift on the shared CI machine (README): a smaller gap is not a result.
NOISE = 1.10
# vLLM's own figure, published, NOT measured here (vLLM cannot be installed on the lent GPU
# machines; issue #51): the vLLM performance dashboard (https://perf.vllm.ai, vLLM's docs'
# "Performance Dashboard"), as issue #51 cites it: "Llama-3.1-8B at batch 8 on an H200 at or
# under ~2.1x its floor". A decode-step time over its floor (the step's memory-bound minimum),
# not a rate: vLLM has no req/s in this table, and none may be inferred from this ratio.
VLLM_PUBLISHED = {
    "name": "vllm (published)",
    "figure": "decode step ≤ ~2.1× its floor (Llama-3.1-8B, batch 8, H200)",
    "source": "vLLM performance dashboard https://perf.vllm.ai, as cited in issue #51",
}


def load_results(out_dir: Path) -> dict[str, dict]:
    """Strategies (sweep.json) then peers (peers.json), failed runs kept; each gets a "kind"."""
    files = [(out_dir / SWEEP_FILE, "strategy"), (out_dir / PEERS_FILE, "peer")]
    if not any(path.is_file() for path, _ in files):
        raise FileNotFoundError(f"{out_dir}: neither {SWEEP_FILE} nor {PEERS_FILE}; run "
                                "`batchyard bench sweep --out` there first")
    results: dict[str, dict] = {}
    for path, kind in files:
        if not path.is_file():
            continue
        for name, entry in json.loads(path.read_text()).items():
            if not isinstance(entry, dict):
                entry = {"error": f"unreadable entry in {path.name}: {str(entry)[:80]}"}
            key = name if name not in results else f"{name} ({kind})"
            results[key] = {"kind": kind, **entry}
    return results


def succeeded(entry: dict) -> bool:
    return "error" not in entry and "requests_per_s" in entry


def is_peer(entry: dict) -> bool:
    return entry.get("kind") == "peer"


def samples(entry: dict, metric: str) -> list[float]:
    """Per-request values of `metric` ("e2e", "ttft", "inter_token"); [] in older results."""
    return [float(v) for v in (entry.get("samples") or {}).get(metric) or []]


def percentile(entry: dict, metric: str, p: str) -> float | None:
    value = (entry.get(metric) or {}).get(p)
    return None if value is None else float(value)


def label(name: str, entry: dict) -> str:
    return f"{name} (peer)" if is_peer(entry) else name


def error_line(entry: dict, width: int = 120) -> str:
    """The first line of why an entry failed, shortened to `width` characters."""
    why = str(entry.get("error") or "no requests_per_s in the result").strip()
    return textwrap.shorten((why.splitlines() or ["no reason given"])[0], width,
                            placeholder=" …")


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def _seconds(value: float | None) -> str:
    return _fmt(value, ".2f" if value is None or value < 10 else ".1f")


def _ms(value: float | None) -> str:
    return _fmt(value, ".1f" if value is not None and value < 0.01 else ".0f", 1000)


def results_table(results: dict[str, dict], goodput: dict[str, str] | None = None,
                  goodput_note: str = "") -> str:
    """A markdown table, one row per entry; failed rows say why; peers' notes follow it.
    `goodput` ({name: goodput in words}, from a `bench goodput` run) adds a last column; it is a
    separate open-loop run under SLOs, so `goodput_note` should say which."""
    head = ["name", "req/s", "output tok/s", "TTFT p50 (s)", "ITL p50 / p99 (ms)",
            "e2e p50 / p99 (s)", "mean batch", "KV holds: workload / max-len seqs",
            "requests (errors)"] + (["goodput under SLOs"] if goodput is not None else [])
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    notes = []
    for name, r in results.items():
        if not succeeded(r):
            reason = error_line(r).replace("|", "\\|")
            cells = [label(name, r), f"failed: {reason}"] + [""] * (len(head) - 2)
        else:
            server = r.get("server") or {}
            cells = [
                label(name, r), _fmt(r["requests_per_s"], ".3f"),
                _fmt(r.get("output_tokens_per_s"), ".1f"), _seconds(percentile(r, "ttft", "p50")),
                " / ".join(_ms(percentile(r, "inter_token", p)) for p in ("p50", "p99")),
                " / ".join(_seconds(percentile(r, "e2e", p)) for p in ("p50", "p99")),
                _fmt(server.get("mean_batch_size"), ".1f"),
                _holds(r), f"{r.get('num_requests', '?')} ({r.get('num_errors', 0)})"]
        if goodput is not None:
            cells = cells[:len(head) - 1] + [goodput.get(name, "–")]
        rows.append("| " + " | ".join(cells) + " |")
        if is_peer(r) and r.get("note"):
            notes.append(f"- **{name}**: {r['note']}")
    if goodput is not None:
        rows += [f"| {name} | (not in this sweep) |" + " |" * (len(head) - 3) + f" {value} |"
                 for name, value in goodput.items() if name not in results]
        notes.append(f"- **goodput under SLOs**: {goodput_note or 'from goodput.json'}")
    if on_gpu(results):
        rows.append(published_row(len(head)))
        notes.append(f"- **{VLLM_PUBLISHED['name']}**: published, not measured here: "
                     f"{VLLM_PUBLISHED['figure']}; source: {VLLM_PUBLISHED['source']}")
    return "\n".join(rows + ([""] + notes if notes else []))


def on_gpu(results: dict[str, dict]) -> bool:
    """A peer measured on a GPU: there vLLM's published GPU figure is the missing neighbour."""
    return any(is_peer(r) and r.get("device") == "cuda" for r in results.values())


def published_row(width: int) -> str:
    """vLLM's published figure: a ratio, so in words across the req/s cell, no number of ours."""
    cells = [VLLM_PUBLISHED["name"],
             f"published, not measured here: {VLLM_PUBLISHED['figure']}"] + [""] * (width - 2)
    return "| " + " | ".join(cells) + " |"


def _holds(entry: dict) -> str:
    """Sequences the KV pool holds at once: of the workload's mean length / of max_model_len
    (a strategy's server says; a peer's result may say the first)."""
    server = entry.get("server") or {}
    workload, max_len = entry.get("kv_workload_concurrency"), server.get("kv_max_concurrency")
    if workload is None and max_len is None:
        return "–"
    return f"{_fmt(workload, '.0f')} / {_fmt(max_len, '.0f')}"


def workload_line(results: dict[str, dict]) -> str:
    """What the load was, from the strategies that ran ("" when none did): the load most of them
    had, and the request count of any that had another (`bench sweep --requests-for`)."""
    done = {name: r for name, r in results.items() if succeeded(r) and not is_peer(r)}
    if not done:
        return ""
    loads = {name: _load(r) for name, r in done.items()}
    common = Counter(loads.values()).most_common(1)[0][0]
    r = next(r for name, r in done.items() if loads[name] == common)
    workload = r.get("workload")
    if isinstance(workload, dict):  # a structured description: its name, if it has one
        workload = workload.get("name")
    others = [f"{name}: {done[name].get('num_requests', '?')} requests"
              for name, load in loads.items() if load != common]
    load = common + (f" ({', '.join(others)})" if others else "")
    return "; ".join(part for part in (workload, load) if isinstance(part, str) and part)


def _load(r: dict) -> str:
    load = r.get("load")
    if isinstance(load, str):
        return load
    return f"{r.get('concurrency', '?')} clients, {r.get('num_requests', '?')} requests"


def _ranked(results: dict[str, dict], *, peers: bool) -> list[tuple[float, str]]:
    return sorted(((r["requests_per_s"], n) for n, r in results.items()
                   if succeeded(r) and is_peer(r) == peers), reverse=True)


def _times(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b > 0 else "∞×"


def summary(results: dict[str, dict], baseline: str = "dynamic") -> str:
    """In words (markdown): which strategy served the most requests/s, and by what ratio."""
    strategies, peers = _ranked(results, peers=False), _ranked(results, peers=True)
    failed = [f"{label(n, r)} ({error_line(r, 80)})" for n, r in results.items()
              if not succeeded(r)]
    tail = [f"Did not run: {'; '.join(failed)}."] if failed else []
    if not strategies or strategies[0][0] <= 0:
        return " ".join(["No strategy completed a request."] + tail)
    best_rps, best = strategies[0]
    errors = results[best].get("num_errors", 0)
    text = [f"**{best}** served the most requests per second: {best_rps:.3f} req/s"
            + (f" ({errors} requests failed)." if errors else ".")]
    compared = {best}
    if len(strategies) > 1:
        rps, runner = strategies[1]
        compared.add(runner)
        text.append(f"That is **{_times(best_rps, rps)} {runner}**, the runner-up "
                    f"({rps:.3f} req/s).")
        if rps > 0 and best_rps / rps < NOISE:
            text.append(f"A gap under {NOISE - 1:.0%} is within this machine's run-to-run "
                        "drift: treat the two as tied.")
    base = results.get(baseline, {})
    if succeeded(base) and not is_peer(base) and baseline not in compared:
        text.append(f"Against {baseline} ({base['requests_per_s']:.3f} req/s) it is "
                    f"**{_times(best_rps, base['requests_per_s'])}**.")
    if peers:
        rps, peer = peers[0]
        text.append(f"The fastest peer, {peer}, served {rps:.3f} req/s: {best} did "
                    f"{_times(best_rps, rps)} its rate.")
    return " ".join(text + tail)


def write_report(out: Path | None, name: str, results: dict, caption: str, table: str) -> None:
    """Print an offline bench's `table`; with `out`, write NAME.json (the results) and NAME.md
    (the caption, then the table) there."""
    print(table)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{name}.md").write_text(f"{caption}\n\n{table}\n")
