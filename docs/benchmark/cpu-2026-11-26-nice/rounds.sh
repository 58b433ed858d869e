#!/usr/bin/env bash
# Alternating rounds on one host: each running server (NAME:PORT), then the offline engine on
# one thread, ROUNDS times (this host's speed moves by up to 2x between runs).
#   bash docs/benchmark/cpu-2026-11-26-nice/rounds.sh ROUNDS REQUESTS NAME:PORT...
set -euo pipefail
ROUNDS=$1; N=$2; shift 2
D=docs/benchmark/cpu-2026-11-26-direct-streams
for r in $(seq "$ROUNDS"); do
  echo "round $r"
  for server in "$@"; do
    echo "  ${server%%:*}: $(python -m benchmark.tools.measure "${server##*:}" "$N")"
  done
  echo "  $(OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmark.tools.offline $D/paged.properties "$N" 2>&1 | tail -1)"
done
