#!/usr/bin/env bash
# The offline engine on vCPU 0, alone and with a pure-Python busy loop on vCPU 1: how much one
# busy vCPU slows the other on this host (both run on one physical core's resources).
#   bash docs/benchmark/cpu-2026-11-26-nice/sibling.sh [ROUNDS] [REQUESTS]
set -euo pipefail
ROUNDS=${1:-3}; N=${2:-1280}
D=docs/benchmark/cpu-2026-11-26-direct-streams
offline() { OMP_NUM_THREADS=1 PYTHONPATH=. taskset -c 0 python -m benchmark.tools.offline $D/paged.properties "$N" 2>&1 | tail -1; }
for r in $(seq "$ROUNDS"); do
  alone=$(offline)
  taskset -c 1 python -c "while True: pass" & spin=$!
  busy=$(offline)
  kill $spin
  echo "round $r: vCPU 1 idle: $alone | vCPU 1 busy: $busy"
done
