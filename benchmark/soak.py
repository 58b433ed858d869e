"""`batchyard bench soak`: many mixed requests against a `batchyard serve` it starts (paged, a
KV pool small enough to force preemption; by default the tests' tiny random model): every route
(/invocations plain, TGI-style and chat, /v1/chat/completions, /v1/completions), streaming and
not, guided, n > 1, a share of clients that hang up (before the answer or mid-stream), a share of
huge (413), malformed or unsatisfiable-grammar (4xx) bodies, more clients than the queue holds
(503 + Retry-After, then retry), while a thread times /ping. A benchmark, not a test: it prints
one JSON report and exits 1 when a target fails (0 5xx, 0 hangs, 0 KV blocks used after idle,
/ping p99 < 1 s; also every greedy answer equals its prompt's answer alone, nothing left running
or waiting)."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmark.servers import local_server
from benchmark.soak_mix import MAX_REQUEST, PROMPTS, Request, hang_up, pick, pick_bad, send

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
PROPERTIES = ("option.rolling_batch=paged\noption.max_model_len=256\noption.block_size=4\n"
              "option.num_kv_blocks=48\noption.max_rolling_batch_size=16\njob_queue_size=16\n"
              f"option.dtype=fp32\noption.max_request_size={MAX_REQUEST}\n")
PING_P99_TARGET_S = 1.0
EXAMPLES = 10  # failing requests kept whole in the report


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="mixed requests, hang-ups and bad bodies against a paged "
                       "server with a small KV pool: 5xx, hangs, leaked KV blocks, /ping p99")
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--hang-ups", type=float, default=0.1, help="share of clients that hang up")
    p.add_argument("--bad", type=float, default=0.01, help="share of huge or malformed bodies")
    p.add_argument("--idle", type=float, default=2.0,
                   help="seconds the server idles before the KV blocks are counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path,
                   help="default: the tests' tiny random model, built in a temporary folder")
    p.add_argument("--json", type=Path, help="also write the report here")


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


def ping_times(url: str, stop: threading.Event, out: list[float], codes: Counter) -> None:
    while not stop.is_set():
        start = time.monotonic()
        try:
            codes[str(requests.get(f"{url}/ping", timeout=10).status_code)] += 1
        except requests.RequestException:
            codes["error"] += 1
        out.append(time.monotonic() - start)
        time.sleep(0.05)


def soak(url: str, n: int, clients: int, hang_ups: float, bad: float, seed: int) -> dict:
    reference = {}
    for p in PROMPTS:  # each prompt's greedy answer alone
        _, ids, _ = send(url, Request("reference", "/invocations", {"inputs": p,
                              "parameters": {"max_new_tokens": 32, "ignore_eos": True,
                                             "details": True}}, reference=p))
        reference[p] = ids
    statuses: dict[str, Counter] = defaultdict(Counter)
    kinds: Counter = Counter()
    failures: dict[str, list] = defaultdict(list)
    counts: Counter = Counter()
    ids = itertools.count()
    lock = threading.Lock()

    def record(req: Request, outcome: str, failure: str | None = None, note: str = "") -> None:
        with lock:
            statuses[req.route][outcome] += 1
            kinds[req.kind] += 1
            if (done := sum(kinds.values())) % 1000 == 0:
                logger.info("soak: %d of %d requests done", done, n)
            if failure:
                counts[failure] += 1
                if len(failures[failure]) < EXAMPLES:
                    failures[failure].append({**req.describe(), "outcome": outcome,
                                              "note": note})

    def client(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        while next(ids) < n:
            draw = rng.random()
            if draw < hang_ups:
                req = pick(rng)
                mid_stream = rng.random() < 0.5
                req.stream = req.stream or mid_stream
                if mid_stream and isinstance(req.body, dict):
                    req.body["stream"] = True
                try:
                    hang_up(url, req, rng, mid_stream)
                    record(req, "hung_up_mid_stream" if mid_stream else "hung_up")
                except OSError as err:
                    record(req, "connection_error", "connection errors", repr(err))
                continue
            req = pick_bad(rng) if draw < hang_ups + bad else pick(rng)
            started = time.monotonic()
            try:
                status, got, retries = send(url, req)
            except requests.Timeout as err:
                record(req, "hang", "hangs", f"{time.monotonic() - started:.0f} s: {err!r}")
                continue
            except requests.RequestException as err:
                # a refused huge body may be cut off while it is still being sent
                record(req, "reset" if req.kind == "huge" else "connection_error",
                       None if req.kind == "huge" else "connection errors", repr(err))
                continue
            with lock:
                counts["503_queue_full_retried"] += retries
            if status >= 500:
                record(req, str(status), "5xx")
            elif (req.kind in ("huge", "malformed", "refused-guided")
                  and not 400 <= status < 500):
                record(req, str(status), "bad bodies not answered 4xx")
            elif req.reference is not None and got != reference[req.reference][:req.max_new]:
                record(req, str(status), "mismatched greedy answers", f"got {got}")
            else:
                record(req, str(status))

    pings: list[float] = []
    ping_codes: Counter = Counter()
    stop = threading.Event()
    pinger = threading.Thread(target=ping_times, args=(url, stop, pings, ping_codes))
    pinger.start()
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
    finally:
        stop.set()
        pinger.join()
    elapsed = time.monotonic() - start
    end = time.monotonic() + 30  # hung-up requests leave within ~0.1 s; the pool drains
    while time.monotonic() < end and (metric(url, "batchyard_running_sequences")
                                      or metric(url, "batchyard_queue_depth")):
        time.sleep(0.2)
    return {"requests": n, "clients": clients, "seconds": round(elapsed, 1),
            "statuses_by_route": statuses, "kinds": kinds, "counts": counts,
            "failures": failures, "pings": pings, "ping_codes": ping_codes}


def report(raw: dict, after: dict) -> dict:
    pings = sorted(raw.pop("pings")) or [0.0]
    ping_codes = raw.pop("ping_codes")
    totals: Counter = Counter()
    for by_status in raw["statuses_by_route"].values():
        totals.update(by_status)
    fivexx = {route: sum(v for k, v in c.items() if k[0] == "5") for route, c in
              raw["statuses_by_route"].items()}
    p99 = pings[max(0, int(len(pings) * 0.99) - 1)]
    out = {**raw, "totals_by_status": totals, "5xx_by_route": {k: v for k, v in fivexx.items()
                                                                if v},
           "5xx": sum(fivexx.values()), "hangs": raw["counts"].get("hangs", 0),
           "leaked_kv_blocks": after["kv_blocks_used"], "after_idle": after,
           "ping": {"count": len(pings), "codes": ping_codes,
                    "p50_ms": round(statistics.median(pings) * 1000, 1),
                    "p99_ms": round(p99 * 1000, 1), "max_ms": round(pings[-1] * 1000, 1)}}
    out["failed"] = [name for name, bad in [
        ("5xx", out["5xx"]), ("hangs (no answer within 120 s)", out["hangs"]),
        ("KV blocks used after idle", out["leaked_kv_blocks"]),
        (f"/ping p99 >= {PING_P99_TARGET_S:.0f} s", p99 >= PING_P99_TARGET_S),
        ("/ping not 200", sum(v for k, v in out["ping"]["codes"].items() if k != "200")),
        ("still running or waiting", after["running_sequences"] + after["queue_depth"]),
        *((name, raw["counts"][name]) for name in ("connection errors",
          "mismatched greedy answers", "bad bodies not answered 4xx")),
    ] if bad]
    return out


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="batchyard-soak-") as tmp:
        model = args.model_dir or _tiny_model(Path(tmp) / "model")
        props = Path(tmp) / "soak.properties"
        props.write_text(PROPERTIES)
        log = Path(tmp) / "server.log"
        with local_server(props, log, model_dir=model) as url:
            raw = soak(url, args.requests, args.clients, args.hang_ups, args.bad, args.seed)
            time.sleep(args.idle)
            after = {name: metric(url, f"batchyard_{name}") for name in (
                "running_sequences", "queue_depth", "kv_blocks_used", "kv_blocks_total",
                "preemptions_total")}
            after["aborted_client_disconnect"] = metric(
                url, 'batchyard_aborted_requests_total{reason="client_disconnect"}')
        summary = report(raw, after)
        if summary["failed"]:  # the server's own account of what went wrong
            summary["server_log_tail"] = log.read_text(errors="replace").splitlines()[-40:]
    text = json.dumps(summary, indent=1, default=dict)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 1 if summary["failed"] else 0


def _tiny_model(path: Path) -> Path:
    """The tests' 2-layer random Llama (tests/ is not an installed package: found from here)."""
    sys.path.insert(0, str(ROOT))
    from tests.models_fixtures import build_tiny_model

    return build_tiny_model(path, max_position_embeddings=256)
