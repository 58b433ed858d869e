"""A wrk script (Lua) that posts raw_client.py's workload to /invocations: 512 different
bodies of 24-token prompts and 64 new tokens (`details` on, EOS ignored), taken in turn.

    python -m benchmark.tools.wrk_script stream > s.lua
    wrk -t1 -c32 -d10s -s s.lua http://127.0.0.1:8141

`stream` asks for streams, `whole` for one JSON body per request. MODEL (default
/tmp/tiny320) is the model whose tokenizer builds the prompts. Written for the native-client run
(docs/benchmark/cpu-2026-11-27-native-client/).
"""

from __future__ import annotations

import argparse
import json
import os

from transformers import AutoTokenizer

from benchmark.workloads import Lengths, synthetic_jobs

BODIES = 512


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.wrk_script",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("stream", "whole"),
                        help="streams, or one JSON body per request")
    stream = parser.parse_args().mode == "stream"
    tokenizer = AutoTokenizer.from_pretrained(os.environ.get("MODEL", "/tmp/tiny320"))
    jobs = synthetic_jobs(BODIES, Lengths.parse("24", "prompt"), Lengths.parse("64", "output"),
                          0, tokenizer)
    bodies = ",".join(f"[==[{json.dumps(job.body(stream=stream))}]==]" for job in jobs)
    print(f"bodies = {{{bodies}}}")
    print('counter = 0\nwrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
          "request = function()\n  counter = counter + 1\n"
          '  return wrk.format(nil, "/invocations", nil, bodies[(counter % #bodies) + 1])\nend')


if __name__ == "__main__":
    main()
