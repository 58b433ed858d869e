#!/usr/bin/env bash
# Alternating rounds on one host: the server before (port 8092) and after (port 8091), then
# the offline engine on one thread, ROUNDS times (this host's speed moves between runs).
#   bash docs/benchmark/cpu-2026-11-26-nice/rounds.sh [ROUNDS] [REQUESTS]
set -euo pipefail
ROUNDS=${1:-4}; N=${2:-1280}
D=docs/benchmark/cpu-2026-11-26-direct-streams
for r in $(seq "$ROUNDS"); do
  echo "round $r"
  echo "  before: $(python $D/measure.py 8092 "$N")"
  echo "  after:  $(python $D/measure.py 8091 "$N")"
  echo "  $(OMP_NUM_THREADS=1 PYTHONPATH=. python $D/offline.py $D/paged.properties "$N" 2>&1 | tail -1)"
done
