"""Served / offline per round, for each client, from a rounds.sh output: the median, the range
and how many rounds reached 0.9.

    python -m benchmark.tools.ratios ROUNDS_OUTPUT

Written for the native-client run (docs/benchmark/cpu-2026-11-27-native-client/: its rounds.sh
and rounds-*.txt).
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict

LINE = re.compile(r"round (\d+) (\S+)\s+(?:Requests/sec: )?\s*([\d.]+)")


def main() -> None:
    rounds: dict[int, dict[str, float]] = defaultdict(dict)
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.ratios",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("rounds_output", help="what rounds.sh printed")
    with open(parser.parse_args().rounds_output) as lines:
        for line in lines:
            if match := LINE.match(line):
                rounds[int(match[1])][match[2]] = float(match[3])
    clients = [name for name in next(iter(rounds.values())) if name != "offline"]
    for name in clients:
        ratios = [r[name] / r["offline"] for r in rounds.values() if name in r]
        rates = [r[name] for r in rounds.values() if name in r]
        print(f"{name:20s} served / offline median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}), {sum(x >= 0.9 for x in ratios)} of "
              f"{len(ratios)} rounds >= 0.9; req/s median {statistics.median(rates):.1f}")
    print(f"offline req/s median {statistics.median(r['offline'] for r in rounds.values()):.1f}")


if __name__ == "__main__":
    main()
