#!/usr/bin/env bash
# Alternating rounds on one host: the server on PORT at each client count, then the offline
# engine on one thread (at 32, max_rolling_batch_size), ROUNDS times.
#   bash docs/benchmark/cpu-2026-11-26-turnaround/clients.sh ROUNDS REQUESTS PORT CLIENTS...
set -euo pipefail
ROUNDS=$1; N=$2; PORT=$3; shift 3
D=docs/benchmark/cpu-2026-11-26-direct-streams
for r in $(seq "$ROUNDS"); do
  echo "round $r"
  for clients in "$@"; do
    echo "  c$clients: $(python -m benchmark.tools.measure "$PORT" "$N" "$clients")"
  done
  echo "  $(OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmark.tools.offline $D/paged.properties "$N" 2>&1 | tail -1)"
done
