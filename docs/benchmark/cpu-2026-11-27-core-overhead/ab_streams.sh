#!/usr/bin/env bash
set -euo pipefail
D=docs/benchmark/cpu-2026-11-26-direct-streams
for r in $(seq "$1"); do
  for s in new:8141 base:8142; do
    echo "round $r ${s%%:*}: $(PYTHONPATH=. python $D/measure.py ${s##*:} 2560 32 2>/dev/null | tail -1)"
  done
  echo "round $r $(OMP_NUM_THREADS=1 PYTHONPATH=. python $D/offline.py $D/paged.properties 2560 2>/dev/null | tail -1)"
done
