#!/usr/bin/env bash
# ROUNDS alternating rounds against the server on PORT (default 8141): wrk with 32 kept
# connections (streams, then whole answers), wrk with a new connection per request
# (streams), raw_client's streams (benchmark.tools.measure), then the offline engine.
#   bash docs/benchmark/cpu-2026-11-27-native-client/rounds.sh ROUNDS
set -euo pipefail
D=docs/benchmark/cpu-2026-11-26-direct-streams
P=${PORT:-8141}
T=$(mktemp -d)
PYTHONPATH=. python -m benchmark.tools.wrk_script stream > "$T/stream.lua" 2>/dev/null
PYTHONPATH=. python -m benchmark.tools.wrk_script whole > "$T/whole.lua" 2>/dev/null
run_wrk() {  # the req/s line, and any line saying some answers failed
  wrk -t1 -c32 -d10s "$@" "http://127.0.0.1:$P" | grep -E "Requests/sec|Non-2xx|errors" | tr -s ' ' | paste -sd ' '
}
for r in $(seq "$1"); do
  echo "round $r wrk-kept-streams $(run_wrk -s "$T/stream.lua")"
  echo "round $r wrk-kept-whole $(run_wrk -s "$T/whole.lua")"
  echo "round $r wrk-closed-streams $(run_wrk -H 'Connection: close' -s "$T/stream.lua")"
  echo "round $r raw-client-streams $(CLIENT_ARGS= PYTHONPATH=. python -m benchmark.tools.measure "$P" 2560 32 2>/dev/null | tail -1)"
  echo "round $r $(OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmark.tools.offline $D/paged.properties 2560 2>/dev/null | tail -1)"
done
rm -r "$T"
