"""The CPU a running server's HTTP worker and engine core spend per request, from /proc, over
one closed loop of raw_client.py (after a warm-up loop). With one client and one new token the
worker's share is almost all per-request work: parsing, routing, tokenizing, the first line.

    python docs/benchmark/cpu-2026-11-26-http-cpu/request_cpu.py PORT [N [CLIENTS [TOKENS]]]
"""

from __future__ import annotations

import os
import subprocess
import sys

CLIENT = "docs/benchmark/cpu-2026-11-25-served-gap/raw_client.py"
TICK = os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, tuple[str, int, float]]:
    """pid -> (command line, parent pid, CPU seconds)."""
    rows = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        rows[int(pid)] = (cmd, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    return rows


def main() -> None:
    defaults = ["3000", "1", "1"]  # requests, clients, new tokens
    port, *given = sys.argv[1:]
    n, clients, tokens = given + defaults[len(given):]
    rows = processes()
    server = {pid for pid, (cmd, _, _) in rows.items() if f"--port {port}" in cmd}
    worker = next(pid for pid in server if rows[pid][1] in server)  # the master's child
    core = next(pid for pid, (cmd, ppid, _) in rows.items()
                if ppid == worker and "spawn_main" in cmd)
    command = [sys.executable, CLIENT, "--port", port, "--model-dir", "/tmp/tiny320",
               "-c", clients, "--output-tokens", tokens]
    subprocess.run([*command, "-n", "32"], capture_output=True, check=True)  # warm-up
    before = processes()
    run = subprocess.run([*command, "-n", n], capture_output=True, text=True, check=True)
    after = processes()
    requests = int(n) + int(clients)  # the client's own warm-up round is not timed, but runs
    worker_us = (after[worker][2] - before[worker][2]) / requests * 1e6
    core_us = (after[core][2] - before[core][2]) / requests * 1e6
    print(f"{run.stdout.strip()} | worker {worker_us:.0f} us/request, core {core_us:.0f}")


if __name__ == "__main__":
    main()
