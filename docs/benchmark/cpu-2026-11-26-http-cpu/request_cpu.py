"""The CPU a running server's HTTP worker and engine core spend per request, from /proc (as
measure.py reads it), over one closed loop of raw_client.py (after a warm-up loop). With one
client and one new token the worker's share is almost all per-request work: parsing, routing,
tokenizing, the first line.

    python docs/benchmark/cpu-2026-11-26-http-cpu/request_cpu.py PORT [N [CLIENTS [TOKENS]]]
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

CLIENT = "docs/benchmark/cpu-2026-11-25-served-gap/raw_client.py"
MEASURE = Path(__file__).parents[1] / "cpu-2026-11-26-direct-streams" / "measure.py"


def load_measure():
    """measure.py (a script in a folder that is no package), for its cpu_seconds(port)."""
    spec = importlib.util.spec_from_file_location("measure", MEASURE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    defaults = ["3000", "1", "1"]  # requests, clients, new tokens
    port, *given = sys.argv[1:]
    n, clients, tokens = given + defaults[len(given):]
    cpu_seconds = load_measure().cpu_seconds  # (HTTP worker, engine core)
    command = [sys.executable, CLIENT, "--port", port, "--model-dir", "/tmp/tiny320",
               "-c", clients, "--output-tokens", tokens]
    subprocess.run([*command, "-n", "32"], capture_output=True, check=True)  # warm-up
    worker0, core0 = cpu_seconds(int(port))
    run = subprocess.run([*command, "-n", n], capture_output=True, text=True, check=True)
    worker1, core1 = cpu_seconds(int(port))
    requests = int(n) + int(clients)  # the client's own warm-up round is not timed, but runs
    worker_us = (worker1 - worker0) / requests * 1e6
    core_us = (core1 - core0) / requests * 1e6
    print(f"{run.stdout.strip()} | worker {worker_us:.0f} us/request, core {core_us:.0f}")


if __name__ == "__main__":
    main()
