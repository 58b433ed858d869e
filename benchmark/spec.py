"""What speculative decoding by n-gram prompt lookup gains: `bench spec` runs the same requests
through the offline engine without speculation and with it (speculative_method "ngram"), at
several concurrencies, closed loop (a new request as each one ends), on two workloads:
`repetitive`, chat requests whose answer repeats their input (a code edit, an answer quoting a
passage: what prompt lookup is for), greedy, ending at EOS or --new-tokens; and `lmi`, the LMI
batching study's three prompts (benchmark/workloads.py) with their exact 64/256/128 new tokens,
EOS ignored. Per run: output tokens/s, ms per output token per request, the speculator's
acceptance rate and mean acceptance length, the ratio to the run without speculation, and
whether both runs generated the same tokens. Figures, not tests."""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import deque
from pathlib import Path

from benchmark.tables import write_report

logger = logging.getLogger(__name__)

WORKLOADS = ("repetitive", "lmi")

# The repetitive workload's two requests, alternated: a code edit whose answer is the snippet
# again with one name changed, and a question answered by quoting a passage (RAG).
CODE = '''\
import math
from dataclasses import dataclass


@dataclass
class Room:
    name: str
    width: float
    length: float
    height: float = 2.5


def area(room: Room) -> float:
    """The floor area of a room in square metres."""
    return room.width * room.length


def wall_area(room: Room) -> float:
    """The area of the four walls, without doors or windows."""
    return 2 * (room.width + room.length) * room.height


def paint_litres(room: Room, coats: int = 2, cover: float = 10.0) -> float:
    """Litres of paint for the walls and the ceiling."""
    surface_total = wall_area(room) + area(room)
    return math.ceil(coats * surface_total / cover * 10) / 10


def report(rooms: list[Room]) -> str:
    lines = []
    total = 0.0
    for room in sorted(rooms, key=area, reverse=True):
        total += area(room)
        lines.append(f"{room.name:<12} {area(room):8.2f} m2 {paint_litres(room):6.1f} l")
    lines.append(f"{'total':<12} {total:8.2f} m2")
    return "\\n".join(lines)


if __name__ == "__main__":
    print(report([Room("kitchen", 3.2, 4.1), Room("bedroom", 3.5, 3.9), Room("hall", 1.2, 6.0)]))
'''

PASSAGE = (
    "The diamondback terrapin is a species of turtle native to the brackish coastal tidal "
    "marshes of the eastern and southern United States, and in Bermuda. It belongs to the "
    "monotypic genus Malaclemys. It has one of the largest ranges of all turtles in North "
    "America, stretching as far south as the Florida Keys and as far north as Cape Cod. The "
    "name terrapin is derived from the Algonquian word torope. The diamondback terrapin is the "
    "only turtle in North America that lives in brackish water, where fresh water from rivers "
    "mixes with salt water from the sea. Terrapins have glands near their eyes that remove "
    "excess salt, and they drink fresh water from the surface after rain. They feed on snails, "
    "crabs, clams, mussels and other small animals of the marsh. Females are much larger than "
    "males and have broader heads and stronger jaws, which let them crush the shells of their "
    "prey. In the nineteenth century terrapin soup was a delicacy, and the animals were hunted "
    "until they nearly disappeared from many places. Today the main dangers are roads built "
    "across the marshes, where females are killed while looking for sandy places to lay their "
    "eggs, and crab traps, in which terrapins drown because they cannot reach the surface to "
    "breathe. Several states now require traps to carry devices that keep terrapins out.")

REPETITIVE_MESSAGES = (
    "Rewrite the following Python code exactly, renaming the function `area` to `surface`:"
    f"\n\n```python\n{CODE}```",
    f"Answer using the passage, quoting it: {PASSAGE}\n\nQuestion: Where do diamondback "
    "terrapins live, what do they eat, and what threatens them today? Quote the sentences "
    "that say so.",
)


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="output tokens/s and time per token with n-gram "
                       "speculative decoding against none, offline, on a repetitive workload "
                       "and the LMI study's")
    p.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    p.add_argument("--batching", choices=("continuous", "paged"), default="paged")
    p.add_argument("--concurrency", default="1,4,32",
                   help="requests running at once, comma-separated (default 1,4,32)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (default: both)")
    p.add_argument("--requests-per-client", type=int, default=2,
                   help="requests per run: concurrency times this, at least 4")
    p.add_argument("--new-tokens", type=int, default=128,
                   help="the repetitive workload's most new tokens (it also ends at EOS)")
    p.add_argument("--lmi-new-tokens-scale", type=float, default=1.0,
                   help="the LMI workload's 64/256/128 new tokens times this (at least 1)")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, help="write spec.json and spec.md here")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from handler.model_source.default_model import ensure_default_model

    model_dir = args.model_dir or ensure_default_model()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"--workloads: unknown workload {unknown[0]} (one of "
                         f"{', '.join(WORKLOADS)})")
    if min(concurrencies) < 1 or args.requests_per_client < 1 or args.new_tokens < 1:
        raise ValueError("--concurrency, --requests-per-client and --new-tokens must be >= 1")
    if args.lmi_new_tokens_scale <= 0:
        raise ValueError("--lmi-new-tokens-scale must be > 0")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    most = max(requests_for(c, args.requests_per_client) for c in concurrencies)
    jobs = {w: workload(w, tokenizer, most, args) for w in workloads}
    max_model_len = max(len(r["prompt_ids"]) + r["new_tokens"]
                        for rs in jobs.values() for r in rs) + 16
    results: dict = {
        "model": model_dir.name, "engine": f"offline, {args.batching} batching",
        "device": args.device, "dtype": args.dtype, "concurrency": concurrencies,
        "requests_per_client": args.requests_per_client, "new_tokens": args.new_tokens,
        "lmi_new_tokens_scale": args.lmi_new_tokens_scale,
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max, "max_model_len": max_model_len,
        "prompt_tokens": {w: sorted({len(r["prompt_ids"]) for r in rs})
                          for w, rs in jobs.items()}, "runs": []}
    engines = {}
    try:  # both engines at once: each cell runs without, then with speculation, back to back
        for spec in (False, True):
            engines[spec] = build_engine(args, model_dir, spec, max(concurrencies),
                                         max_model_len)
            for w in workloads:  # warm-up, not measured: one request decoding at full
                # context (without it the first run measured was ~2x slower), then batched
                closed_loop(engines[spec], [{**jobs[w][0], "new_tokens": 32}], 1, f"warm1-{w}-")
                closed_loop(engines[spec], [{**r, "new_tokens": 2} for r in jobs[w][:4]],
                            min(4, max(concurrencies)), f"warm-{w}-")
        results["device_type"] = engines[False].runner.device.type
        results["model_dtype"] = str(engines[False].runner.kv_cache.dtype).removeprefix("torch.")
        for w in workloads:
            for c in concurrencies:
                requests = jobs[w][:requests_for(c, args.requests_per_client)]
                base = None
                for spec in (False, True):
                    row, tokens = measure(engines[spec], w, c, requests, spec)
                    if base is None:
                        base = (row, tokens)
                    else:
                        row["ratio_to_no_spec"] = round(row["output_tokens_per_s"]
                                                        / base[0]["output_tokens_per_s"], 3)
                        row["outputs_match_no_spec"] = tokens == base[1]
                    results["runs"].append(row)
                    logger.info("%s, concurrency %d, %s: %.1f tokens/s", w, c,
                                "ngram" if spec else "no speculation",
                                row["output_tokens_per_s"])
    finally:
        for engine in engines.values():
            engine.close()
    report(results, args.out)
    return 0


def requests_for(concurrency: int, per_client: int) -> int:
    return max(4, concurrency * per_client)


def workload(name: str, tokenizer, count: int, args: argparse.Namespace) -> list[dict]:
    """`count` requests of the workload: prompt ids (as the server encodes them), new tokens,
    and whether EOS ends them."""
    if name == "repetitive":
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}],
                                                 add_generation_prompt=True, tokenize=True)
                   for m in REPETITIVE_MESSAGES]
        prompts = [list(getattr(p, "input_ids", p)) for p in prompts]  # BatchEncoding or ids
        return [{"prompt_ids": prompts[i % len(prompts)], "new_tokens": args.new_tokens,
                 "ignore_eos": False} for i in range(count)]
    from benchmark.workloads import lmi_jobs

    scale = args.lmi_new_tokens_scale
    return [{"prompt_ids": tokenizer.encode(job.prompt),
             "new_tokens": max(1, round(job.new_tokens * scale)), "ignore_eos": True}
            for job in lmi_jobs(count)]


def build_engine(args: argparse.Namespace, model_dir: Path, spec: bool, seqs: int,
                 max_model_len: int):
    from engine import EngineConfig, LLMEngine

    speculation = ({"speculative_method": "ngram",
                    "num_speculative_tokens": args.num_speculative_tokens,
                    "prompt_lookup_min": args.prompt_lookup_min,
                    "prompt_lookup_max": args.prompt_lookup_max} if spec else {})
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), batching=args.batching, max_num_seqs=seqs,
        max_model_len=max_model_len, device=args.device, dtype=args.dtype, **speculation))
    engine.guided.wait_built()  # its background build would slow the first steps measured
    return engine


def closed_loop(engine, requests: list[dict], concurrency: int, tag: str) -> list[dict]:
    """`concurrency` requests in flight, the next added as one ends; per request: when it was
    added, the time of each token (the return of the step that gave it) and the tokens."""
    from engine import SamplingParams

    pending = deque(enumerate(requests))
    live: dict[str, dict] = {}
    done: list[dict | None] = [None] * len(requests)

    def submit() -> None:
        i, r = pending.popleft()
        n = r["new_tokens"]
        live[f"{tag}{i}"] = {"index": i, "start": time.perf_counter(), "times": [],
                             "tokens": []}
        engine.add_request(f"{tag}{i}", r["prompt_ids"], SamplingParams(
            max_new_tokens=n, min_new_tokens=n if r["ignore_eos"] else 0,
            ignore_eos=r["ignore_eos"]))

    while pending and len(live) < concurrency:
        submit()
    while live:
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            if event.error:
                raise RuntimeError(f"request {event.request_id}: {event.error}")
            request = live[event.request_id]
            if event.token_id is not None:
                request["times"].append(now)
                request["tokens"].append(event.token_id)
            if event.finished:
                request["end"] = now
                done[request["index"]] = live.pop(event.request_id)
                if pending:
                    submit()
    return [r for r in done if r is not None]


def measure(engine, name: str, concurrency: int, requests: list[dict],
            spec: bool) -> tuple[dict, list[list[int]]]:
    """One run: its row of figures, and every request's tokens (in request order)."""
    counters = engine.speculator.counters if engine.speculator is not None else None
    before = (counters.drafts, counters.draft_tokens, counters.accepted_tokens) if counters \
        else None
    started = time.perf_counter()
    done = closed_loop(engine, requests, concurrency, f"{name}-c{concurrency}-{int(spec)}-")
    seconds = time.perf_counter() - started
    tokens = sum(len(r["tokens"]) for r in done)
    # ms per output token of each request: from its first token to its last, over the gaps
    per_token = [1000 * (r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1)
                 for r in done if len(r["times"]) > 1]
    row: dict = {"workload": name, "concurrency": concurrency, "speculation": spec,
                 "requests": len(done), "generated_tokens": tokens,
                 "seconds": round(seconds, 2), "output_tokens_per_s": round(tokens / seconds, 1),
                 "ms_per_token_mean": round(statistics.fmean(per_token), 2) if per_token
                 else None,
                 "ms_per_token_p50": round(statistics.median(per_token), 2) if per_token
                 else None,
                 "ttft_mean_ms": round(1000 * statistics.fmean(
                     r["times"][0] - r["start"] for r in done if r["times"]), 1)}
    if counters is not None:
        drafts = counters.drafts - before[0]
        proposed = counters.draft_tokens - before[1]
        accepted = counters.accepted_tokens - before[2]
        row.update({"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
                    "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
                    "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts
                    else 0.0})
    return row, [r["tokens"] for r in done]


def table(results: dict) -> str:
    lines = ["| workload | concurrency | speculation | requests | tokens | output tok/s | "
             "ms/token mean / p50 | TTFT mean (ms) | acceptance rate | mean acceptance length "
             "| vs no spec | same tokens |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["runs"]:
        spec = row["speculation"]
        ms = (f"{row['ms_per_token_mean']:.1f} / {row['ms_per_token_p50']:.1f}"
              if row["ms_per_token_mean"] is not None else "–")
        lines.append(
            f"| {row['workload']} | {row['concurrency']} | {'ngram' if spec else 'off'} | "
            f"{row['requests']} | {row['generated_tokens']} | "
            f"{row['output_tokens_per_s']:.1f} | {ms} | {row['ttft_mean_ms']:.0f} | "
            + (f"{100 * row['acceptance_rate']:.1f}% | {row['mean_acceptance_length']:.2f} | "
               f"**{row['ratio_to_no_spec']:.2f}x** | "
               f"{'yes' if row['outputs_match_no_spec'] else 'NO'} |" if spec
               else "– | – | 1.00x | – |"))
    return "\n".join(lines)


def report(results: dict, out: Path | None) -> None:
    caption = (
        f"`bench spec`: {results['model']}, {results['engine']}, closed loop at concurrency "
        f"{', '.join(map(str, results['concurrency']))} "
        f"({results['requests_per_client']} requests per client, at least 4 per run); "
        f"speculation: ngram, {results['num_speculative_tokens']} tokens, prompt lookup "
        f"{results['prompt_lookup_min']}..{results['prompt_lookup_max']}. repetitive: a "
        f"code edit and a quoting answer alternated, greedy, up to {results['new_tokens']} "
        f"new tokens (EOS ends them); lmi: the LMI study's prompts, 64/256/128 new tokens "
        f"x {results['lmi_new_tokens_scale']:g}, EOS ignored. ms/token: per request, from "
        f"its first token to its last over the gaps.")
    write_report(out, "spec", results, caption, table(results))
