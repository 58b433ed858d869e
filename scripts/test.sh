#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite on CPU, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
