"""Means of a served request's segments from trace.patch's marks (files marks.PID and
client.marks in the folder given, default /tmp/trace): where a finished request's slot waits.

    python docs/benchmark/cpu-2026-11-27-core-pipes/turnaround.py [FOLDER]
"""

from __future__ import annotations

import glob
import statistics
import sys
from collections import defaultdict

SEGMENTS = (("H", "S", "handler start -> submitted"), ("S", "A", "submitted -> the core has it"),
            ("A", "T", "the core has it -> first token out of the core"),
            ("T", "F", "first token -> last token out of the core"),
            ("F", "R", "last token: core -> output thread"),
            ("R", "W", "output thread: update in -> final chunk sent"),
            ("W", "E0", "final chunk -> request thread ends the stream"),
            ("E0", "E1", "end of stream (metrics, log line)"), ("H", "E1", "handler start -> end"))


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp/trace"
    client = [line.split() for line in open(f"{folder}/client.marks")]
    ends = [float(t) for tag, t in client if tag == "e"]
    first, last = min(float(t) for _, t in client), max(ends)
    marks: dict[str, dict[str, float]] = defaultdict(dict)
    for path in glob.glob(f"{folder}/marks.*"):
        for line in open(path):
            parts = line.split()
            if len(parts) == 3 and first <= float(parts[2]) <= last:
                marks[parts[1]].setdefault(parts[0], float(parts[2]))
    for a, b, name in SEGMENTS:
        gaps = sorted(m[b] - m[a] for m in marks.values() if a in m and b in m)
        if gaps:
            median, p90 = gaps[len(gaps) // 2], gaps[len(gaps) * 9 // 10]
            print(f"{name:48s} n={len(gaps):5d} mean {statistics.mean(gaps) * 1e3:6.2f} ms, "
                  f"median {median * 1e3:6.2f}, p90 {p90 * 1e3:6.2f}")
    print(f"client's cycle (clients / req/s): {32 * (last - first) / len(ends) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
