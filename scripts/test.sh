#!/usr/bin/env bash
# Set up (first run only), type check (mypy), and run the whole test suite on CPU, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Type check engine/ and handler/ ([tool.mypy] in pyproject.toml); a failure stops here.
.venv/bin/python -m mypy
# The 25 slowest tests close the report: where the suite's time goes, run by run.
exec .venv/bin/python -m pytest --durations=25 "$@"
