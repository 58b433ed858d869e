"""One line per request of a served run, from the server log's summary lines, in arrival order:
when it arrived, got its first token and ended (seconds from the first arrival), flagged where
the time to first token passed 100 ms.

    python -m benchmark.tools.timeline docs/benchmark/gpu-h100-2026-11-26/paged-2GiB.server.log

Written for the H100 run of 2026-11-26 (docs/benchmark/gpu-h100-2026-11-26/, "A request-by-request
timeline"), to see which requests waited in a burst.
"""

import argparse
import re

LINE = re.compile(r"(\d\d):(\d\d):(\d\d),(\d+) .*request (req-\d+): \d+ prompt tokens, "
                  r"(\d+) generated.*ttft (\d+) ms, total (\d+) ms")


def main(path: str) -> None:
    rows = []
    for line in open(path):
        m = LINE.search(line)
        if m is None:
            continue
        h, mi, s, ms, request, generated, ttft, total = m.groups()
        end = int(h) * 3600 + int(mi) * 60 + int(s) + int(ms) / 1000
        start = end - int(total) / 1000
        rows.append((start, start + int(ttft) / 1000, end, request, int(generated), int(ttft)))
    rows.sort()
    t0 = rows[0][0]
    for start, first, end, request, generated, ttft in rows:
        flag = "  <== waited" if ttft > 100 else ""
        print(f"{request:8s} {generated:3d} tokens  arrived {start - t0:6.3f}  first token "
              f"{first - t0:6.3f}  ended {end - t0:6.3f}  ttft {ttft} ms{flag}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.timeline",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("log", help="a served run's server log")
    main(parser.parse_args().log)
