#!/bin/bash
# The default model's four strategies, the HTTP threads at niceness 19 then 0, two rounds:
#   bash alternate.sh TREE OUT   (TREE: the checkout to serve from; OUT: where the runs go)
# Run from a checkout whose .venv has the dependencies; nothing else running.
set -e
tree=${1:?a checkout}; out=${2:?an output folder}
venv=$(cd "$(dirname "$0")/../../.." && pwd)/.venv
cd "$tree" && source "$venv/bin/activate" && export PYTHONPATH=$tree
for round in 1 2; do
  for run in none:8 dynamic:96 continuous:96 paged:160; do
    name=${run%%:*}; n=${run##*:}
    for nice in 19 0; do
      python -m handler.cli bench sweep "serving.properties.d/$name.properties" \
        --kv-cache-memory 720MiB -c 32 -n "$n" --set "option.api_server_nice=$nice" \
        --out "$out/$name-$nice-$round" > "$out/$name-$nice-$round.log" 2>&1
    done
  done
done
