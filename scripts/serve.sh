#!/usr/bin/env bash
# Set up (first run only) and start the server on localhost:8080. Extra arguments go to
# `batchyard serve`, e.g. --properties serving.properties.d/continuous.properties
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/batchyard serve "$@"
