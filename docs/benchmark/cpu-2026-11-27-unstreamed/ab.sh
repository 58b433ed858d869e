#!/usr/bin/env bash
# Alternating rounds: two servers (new on 8141, base on 8142, the base from a git worktree with
# PYTHONPATH set to it) with raw_client.py --no-stream (CLIENT_ARGS, when set, instead: empty for
# streams), then the offline engine, ROUNDS times.
#   bash docs/benchmark/cpu-2026-11-27-unstreamed/ab.sh ROUNDS
set -euo pipefail
D=docs/benchmark/cpu-2026-11-26-direct-streams
ARGS=${CLIENT_ARGS---no-stream}
for r in $(seq "$1"); do
  for s in new:8141 base:8142; do
    echo "round $r ${s%%:*} ${ARGS:-streams}: $(CLIENT_ARGS=$ARGS PYTHONPATH=. python -m benchmark.tools.measure ${s##*:} 2560 32 2>/dev/null | tail -1)"
  done
  echo "round $r $(OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmark.tools.offline $D/paged.properties 2560 2>/dev/null | tail -1)"
done
