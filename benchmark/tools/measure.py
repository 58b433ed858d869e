"""One closed-loop run of raw_client.py against a running server, with what the server spent:
req/s, mean sequences per step and step time (from /metrics), and the CPU seconds per output
token of its HTTP worker and of its engine core process (from /proc), whose ratio does not move
with this machine's speed.

    python -m benchmark.tools.measure PORT [N [CLIENTS]]

MODEL in the environment (default /tmp/tiny320) is the model whose tokenizer the client uses;
CLIENT_ARGS, more arguments for raw_client.py (e.g. --wake-at-end).

Written for the direct-streams run (docs/benchmark/cpu-2026-11-26-direct-streams/); the served
rounds of the later served / offline runs (nice, http-cpu, turnaround, unstreamed, core-overhead,
native-client, the GPU served-ratio runs) and scripts/gpu_check.sh's ratio check use it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import urllib.request

MODEL = os.environ.get("MODEL", "/tmp/tiny320")
CLIENT_ARGS = os.environ.get("CLIENT_ARGS", "").split()  # e.g. --wake-at-end
CLIENT = ["-m", "benchmark.tools.raw_client"]
TICK = os.sysconf("SC_CLK_TCK")
STEP_FACTS = ("batchyard_step_seconds_sum", "batchyard_step_seconds_count",
              "batchyard_batch_size_sum", "batchyard_generation_tokens_total",
              "batchyard_graph_steps_total")


def cpu_seconds(port: int) -> tuple[float, float]:
    """(HTTP worker, engine core) CPU seconds of the server listening on `port`."""
    rows = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        rows[int(pid)] = (cmd, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    server = {pid for pid, (cmd, _, _) in rows.items() if f"--port {port}" in cmd}
    worker = next(pid for pid in server if rows[pid][1] in server)  # the master's child
    core = next(pid for pid, (cmd, ppid, _) in rows.items()
                if ppid == worker and "spawn_main" in cmd)
    return rows[worker][2], rows[core][2]


def step_facts(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return {name: sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
            for name in STEP_FACTS}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.measure",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int, help="the running server's port on 127.0.0.1")
    parser.add_argument("n", nargs="?", default="1280", help="requests (default 1280)")
    parser.add_argument("clients", nargs="?", default="32", help="clients (default 32)")
    args = parser.parse_args()
    port, n, clients = args.port, args.n, args.clients
    (http0, core0), facts0 = cpu_seconds(port), step_facts(port)
    run = subprocess.run([sys.executable, *CLIENT, "--port", str(port), "--model-dir",
                          MODEL, "-n", n, "-c", clients, *CLIENT_ARGS],
                         capture_output=True, text=True, check=True)
    (http1, core1), facts1 = cpu_seconds(port), step_facts(port)
    d = {name: facts1[name] - facts0[name] for name in STEP_FACTS}
    tokens, steps = d["batchyard_generation_tokens_total"], d["batchyard_step_seconds_count"]
    print(f"{float(run.stdout.split()[0]):6.1f} req/s | batch "
          f"{d['batchyard_batch_size_sum'] / steps:4.1f} step "
          f"{d['batchyard_step_seconds_sum'] / steps * 1e3:4.2f} ms graphs "
          f"{d['batchyard_graph_steps_total'] / steps:4.0%} | http "
          f"{(http1 - http0) / tokens * 1e6:5.1f} us/tok core {(core1 - core0) / tokens * 1e6:5.1f}"
          f" us/tok ratio {(http1 - http0) / (core1 - core0):.2f}")


if __name__ == "__main__":
    main()
