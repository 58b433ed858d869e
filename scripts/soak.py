"""Soak: many mixed requests against a real `batchyard serve` on a tiny random model whose KV
pool is small enough to force preemption, with a share of clients hanging up (streaming or not)
and more clients than the queue holds (503 + Retry-After, then retry), while a thread times
/ping. Afterwards nothing runs or waits, every KV block is free, and every greedy answer's
tokens equal the same prompt's answer alone.

    .venv/bin/python scripts/soak.py [--requests 10000] [--clients 48] [--disconnect 0.1]

Prints one JSON summary; exits 1 when an invariant fails. CPU only, offline."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/ (the tiny model builder) is not an installed package

from benchmark.servers import local_server  # noqa: E402
from tests.models_fixtures import build_tiny_model  # noqa: E402

logger = logging.getLogger("soak")
PROPERTIES = ("option.rolling_batch=paged\noption.max_model_len=256\noption.block_size=4\n"
              "option.num_kv_blocks=48\noption.max_rolling_batch_size=16\njob_queue_size=16\n"
              "option.dtype=fp32\n")
PROMPTS = [f"Once upon a time {i} the capital of France" for i in range(16)]
MAX_NEW = 32


def body(prompt: str, max_new: int, stream: bool) -> dict:
    return {"inputs": prompt, "stream": stream,
            "parameters": {"max_new_tokens": max_new, "ignore_eos": True, "details": True}}


def token_ids(url: str, prompt: str, max_new: int,
              stream: bool) -> tuple[int, list[int], int]:
    """(status, generated token ids, 503s retried) of one request; retried while the queue is
    full."""
    retries = 0
    while True:
        r = requests.post(f"{url}/invocations", json=body(prompt, max_new, stream),
                          stream=stream, timeout=300)
        if r.status_code != 503 or r.json().get("type") != "QueueFull":
            break
        retries += 1
        time.sleep(float(r.headers.get("Retry-After", "1")) * random.random())
    if r.status_code != 200:
        return r.status_code, [], retries
    if not stream:
        return 200, [t["id"] for t in r.json()["details"]["tokens"]], retries
    lines = [json.loads(line) for line in r.iter_lines() if line]
    return 200, [line["token"]["id"] for line in lines if "token" in line], retries


def hang_up(url: str, prompt: str, rng: random.Random) -> None:
    """Send a whole request, wait a little (queued or running by then), close the socket."""
    address = urlparse(url)
    data = json.dumps(body(prompt, MAX_NEW, rng.random() < 0.5)).encode()
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(f"POST /invocations HTTP/1.1\r\nHost: soak\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(rng.random() * 0.3)


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


def ping_times(url: str, stop: threading.Event, out: list[float], codes: Counter) -> None:
    while not stop.is_set():
        start = time.monotonic()
        try:
            codes[requests.get(f"{url}/ping", timeout=10).status_code] += 1
        except requests.RequestException:
            codes["error"] += 1
        out.append(time.monotonic() - start)
        time.sleep(0.05)


def soak(url: str, n: int, clients: int, disconnect: float) -> dict:
    reference = {p: token_ids(url, p, MAX_NEW, False)[1] for p in PROMPTS}  # each alone
    counts: Counter = Counter()
    ids = itertools.count()
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while (i := next(ids)) < n:
            prompt = PROMPTS[i % len(PROMPTS)]
            retries = 0
            if rng.random() < disconnect:
                hang_up(url, prompt, rng)
                outcome = "hung_up"
            else:
                max_new = rng.randint(1, MAX_NEW)
                status, got, retries = token_ids(url, prompt, max_new, rng.random() < 0.3)
                outcome = ("mismatch" if got != reference[prompt][:max_new] else "ok") \
                    if status == 200 else f"status_{status}"
            with lock:
                counts[outcome] += 1
                counts["503_queue_full_retried"] += retries

    pings: list[float] = []
    ping_codes: Counter = Counter()
    stop = threading.Event()
    pinger = threading.Thread(target=ping_times, args=(url, stop, pings, ping_codes))
    pinger.start()
    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    elapsed = time.monotonic() - start
    stop.set()
    pinger.join()
    end = time.monotonic() + 30  # hung-up requests leave within ~0.1 s; the pool drains
    while time.monotonic() < end and (metric(url, "batchyard_running_sequences")
                                      or metric(url, "batchyard_queue_depth")):
        time.sleep(0.2)
    pings.sort()
    return {
        "requests": n, "clients": clients, "seconds": round(elapsed, 1), "outcomes": counts,
        "ping": {"count": len(pings), "codes": ping_codes,
                 "p50_ms": round(statistics.median(pings) * 1000, 1),
                 "p99_ms": round(pings[int(len(pings) * 0.99) - 1] * 1000, 1),
                 "max_ms": round(pings[-1] * 1000, 1)},
        "after": {name: metric(url, f"batchyard_{name}") for name in (
            "running_sequences", "queue_depth", "kv_blocks_used", "kv_blocks_total",
            "preemptions_total")},
        "aborted_client_disconnect": metric(
            url, 'batchyard_aborted_requests_total{reason="client_disconnect"}'),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--disconnect", type=float, default=0.1, help="share that hang up")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="batchyard-soak-") as tmp:
        model = build_tiny_model(Path(tmp) / "model", max_position_embeddings=256)
        props = Path(tmp) / "soak.properties"
        props.write_text(PROPERTIES)
        with local_server(props, Path(tmp) / "server.log", model_dir=model) as url:
            summary = soak(url, args.requests, args.clients, args.disconnect)
    after = summary["after"]
    failed = [name for name, bad in [
        ("mismatched greedy answers", summary["outcomes"].get("mismatch", 0)),
        ("other statuses", sum(v for k, v in summary["outcomes"].items()
                               if k.startswith("status_"))),
        ("still running or waiting", after["running_sequences"] + after["queue_depth"]),
        ("KV blocks still used", after["kv_blocks_used"]),
        ("/ping not 200", sum(v for k, v in summary["ping"]["codes"].items() if k != 200)),
    ] if bad]
    summary["failed"] = failed
    print(json.dumps(summary, indent=1, default=dict))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
