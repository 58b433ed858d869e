"""The CPU a running server's HTTP worker and engine core spend per request, from /proc (as
measure.py reads it), over one closed loop of raw_client.py (after a warm-up loop). With one
client and one new token the worker's share is almost all per-request work: parsing, routing,
tokenizing, the first line.

    python -m benchmark.tools.request_cpu PORT [N [CLIENTS [TOKENS]]]

Written for the http-cpu run (docs/benchmark/cpu-2026-11-26-http-cpu/); the native-client run
(docs/benchmark/cpu-2026-11-27-native-client/) used it again.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from benchmark.tools.measure import cpu_seconds

CLIENT = ["-m", "benchmark.tools.raw_client"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.request_cpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("port", help="the running server's port on 127.0.0.1")
    parser.add_argument("n", nargs="?", default="3000", help="requests (default 3000)")
    parser.add_argument("clients", nargs="?", default="1", help="clients (default 1)")
    parser.add_argument("tokens", nargs="?", default="1", help="new tokens (default 1)")
    args = parser.parse_args()
    port, n, clients, tokens = args.port, args.n, args.clients, args.tokens
    command = [sys.executable, *CLIENT, "--port", port, "--model-dir", "/tmp/tiny320",
               "-c", clients, "--output-tokens", tokens]
    subprocess.run([*command, "-n", "32"], capture_output=True, check=True)  # warm-up
    worker0, core0 = cpu_seconds(int(port))  # (HTTP worker, engine core)
    run = subprocess.run([*command, "-n", n], capture_output=True, text=True, check=True)
    worker1, core1 = cpu_seconds(int(port))
    requests = int(n) + int(clients)  # the client's own warm-up round is not timed, but runs
    worker_us = (worker1 - worker0) / requests * 1e6
    core_us = (core1 - core0) / requests * 1e6
    print(f"{run.stdout.strip()} | worker {worker_us:.0f} us/request, core {core_us:.0f}")


if __name__ == "__main__":
    main()
