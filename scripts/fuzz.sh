#!/usr/bin/env bash
# The HTTP fuzz suite (tests/test_fuzz_http.py) at length: scripts/fuzz.sh [EXAMPLES] runs
# EXAMPLES examples per property (default 10000; the gunicorn smoke runs a quarter of that),
# with fresh random examples each run (BATCHYARD_FUZZ_RANDOM=1). CPU only, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
examples="${1:-10000}"
case "$examples" in ''|*[!0-9]*) echo "usage: scripts/fuzz.sh [EXAMPLES]" >&2; exit 2 ;; esac
export BATCHYARD_FUZZ_EXAMPLES="$examples" BATCHYARD_FUZZ_RANDOM=1
exec .venv/bin/python -m pytest tests/test_fuzz_http.py -q -p no:cacheprovider \
    --hypothesis-show-statistics "${@:2}"
