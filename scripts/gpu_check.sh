#!/usr/bin/env bash
# Issue #17's GPU checklist as one command for a lent GPU machine (the `device` tool), so that a
# session with a GPU spends its few minutes on checks, not on set-up. Everything lands in $OUT:
# summary.txt (one line per step, the start-up checks' verdicts), log.txt (all output) and
# profile-*/profile.{json,md} (`bench profile`, async scheduling on and off).
#
#   scripts/gpu_check.sh --fetch     here, once per session: the wheels the device image lacks
#                                    (it has torch, no flask/gunicorn/llguidance; transformers
#                                    and tokenizers at our pins) and the default model's
#                                    tokenizer, into .gpu-carry/ (git-ignored, ~24 MB)
#   device run: command "scripts/gpu_check.sh", carry [".gpu-carry"], timeout_s 600
#   (the steps' limits add up to ~560 s, so the verdicts at the end always come back)
# Seen on an H200 (2026-11-26): tests 113 s, profiles 29 + 22 s, sweep 182 s, served 107 s (each
# with ~15 s of set-up): CHECKS="tests profile sweep" took 367 s of a 560 s call, and a second
# call, PRESETS=llama-7b CHECKS=profile, 111 s (a machine starts in ~30 s). On an H100 (the
# same day, later): tests 170 s (timed out) + 118 s for the fresh-process compile test's CPU
# and CUDA cases (only the CUDA one runs here now), sweep with SWEEP_REQUESTS=320 119 + 159 s.
#
# Rehearse on CPU (the CUDA tests skip, the profile runs a tiny model):
#   PYTHON=.venv/bin/python DEVICE=cpu PRESETS=llama-tiny OUT=/tmp/gpu-check scripts/gpu_check.sh
# PRESETS="llama-1b llama-7b" adds a 7B-shaped model (~13 GB of random weights: ~3 more minutes;
# then give the device call its full 600 s and run fewer tests, or run 7B in a second call).
# CHECKS picks the parts (default "tests profile"; PYTEST_K narrows the tests, pytest's -k).
# CHECKS=sweep: the README's GPU sweep (LMI workload, 32 clients, 96 requests; paged,
# continuous and dynamic at 2 GiB of KV, then at 512 MiB, where the contiguous strategies hold
# 8 sequences; ~3 min on the H200 of 11-26) into
# sweep-kv-*.json, the logs into sweep-logs.tar.gz. CHECKS=served, in a second call, serves the
# first preset over HTTP with option.api_server_count 1 and then 2 (128 streaming clients,
# benchmark/tools/raw_client.py) and puts req/s and time to first byte in summary.txt.
# CHECKS=ratio: #17's served/offline ratio where the host has cores to spare: the tiny model on
# CPU, offline and served on cores 0-1 with the load generator on cores 2-3 and then on 0-1 too
# (~4.5 min on the H200 machine of 11-26); then the first preset on the GPU, offline and served
# at 32 and 40 clients (~4 min). Alone in a call with timeout_s 600 (OFFLINE_ROUNDS=1 saves 50 s;
# RATIO_CPU=0 skips the CPU part, GPU_CLIENTS picks the GPU rounds; on an H100 on 11-27 the GPU
# part alone took 218 s, 100 graphs captured in 9.2 s of a 33.5 s load).
# CHECKS=stall: `bench stall` (8 running decodes, a 2,000-token prompt admitted beside them) on
# the first preset, paged with graphs and with option.enforce_eager (~1-2 min): the decodes'
# inter-token p99 and the prompt's latency, whose 512-token chunks replay piecewise graphs.
# CHECKS=wide: `bench profile` of the first preset with 200- and 1000-token prompts (decode
# at batch 8 and 32 beside those contexts, and a prompt admitted beside them), graphs against
# --enforce-eager (~2-3 min): whether a graph whose attention gathers rows x context of KV
# beats the eager step there (steps up to 512 rows replay graphs since 9cd79d2; those past
# the gather bound, a 512-token chunk beside 1,000-token contexts, replay piecewise graphs
# since stop 46: their "graphs" share says whether they did).
# CHECKS=peers: issue #51's GPU peer: `bench peers batchyard hf-cb` on the first preset on the
# GPU (LMI workload, 32 clients, PEERS_REQUESTS=96), batchyard's paged engine offline against
# transformers' continuous batching (generate_batch's paged cache), both given one KV budget
# (PEERS_KV=512MiB: under paged.properties' 32 x 2,048-token cap, so both pools hold the same
# tokens); each side's req/s, errors and KV pool in summary.txt, with vLLM's published figure
# (not measured here), and peers.json. Bounded at 280 s (with the model: alone in a call, or
# after CHECKS=tests).
# CHECKS=quant: issue #53's `bench quant` of the first preset (bf16 / int8 / int4 / fp8 weight
# bytes, decode tok/s at batch 1 and 32, req/s; which layer types ran), bounded at 240 s.
# CHECKS=spec: issue #54's `bench spec` of the first preset (random weights: acceptance is low,
# so it measures what verification costs), bounded at 240 s. Both: alone in a call (~4-5 min).
# CHECKS=disagg: issue #55's `bench runahead` of the first preset (TTFT of one 4,000-token
# prompt: colocated, one prefill worker, two sharing it), bounded at 240 s, then `bench
# goodput` of paged against 1 + 1 disaggregated workers on the one card (240 s; SLOs 500 / 50
# ms, GOODPUT_RATES): alone in a call.
# CHECKS=kernels: issue #51's attention kernels against the hardware floor: `bench profile` of
# the first preset with --attention-backend triton and then flex, KERNEL_PROMPTS="200 1000"
# tokens, decode at KERNEL_BATCHES=8,32 (and a prompt admitted beside them), graphs on; one
# summary line per row: the backend used, step and device-busy ms, the floor (weights + K/V
# read, at the card's HBM bandwidth) and step/floor (#51: 1B decode at batch 32 <= 2x), and
# kernels-*.json. 4 profiles of ~40-70 s (a wide profile's ~35 s, plus the kernels' compiles),
# each bounded at 110 s: alone in a call with the model (~3-5 min). KERNEL_HBM=TB/s sets the
# bandwidth where the card is not in benchmark/profile.py's table (no floor on the CPU).
# Rehearse on CPU with KERNEL_PROMPTS=20 KERNEL_BATCHES=2 KERNEL_STEPS=2 KERNEL_HBM=0.05
# (triton runs interpreted there: slow; ~20 s in all).
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu-carry
# What the device's image lacks; carried at the versions this checkout's .venv runs (installed
# from pyproject.toml's pins), so that the device runs what CI tests.
WHEEL_NAMES=(flask werkzeug blinker itsdangerous gunicorn llguidance transformers tokenizers)
SDIST_NAMES=(gunicorn-h1c)  # published as source only: built on the device (its compiler)

pins() {  # NAME...: NAME==VERSION for each, as installed in .venv
    .venv/bin/python -c 'import importlib.metadata as m, sys
print(*(f"{name}=={m.version(name)}" for name in sys.argv[1:]))' "$@"
}

if [ "${1:-}" = --fetch ]; then
    wheels=$(pins "${WHEEL_NAMES[@]}") && sdists=$(pins "${SDIST_NAMES[@]}") || exit 1
    read -ra WHEELS <<< "$wheels" && read -ra SDISTS <<< "$sdists"
    rm -rf "$CARRY/new" && mkdir -p "$CARRY/new/wheels" "$CARRY/new/sdist" "$CARRY/tokenizer"
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$CARRY/new/wheels" "${WHEELS[@]}" || exit 1
    .venv/bin/python -m pip download --quiet --no-deps --no-binary=:all: \
        -d "$CARRY/new/sdist" "${SDISTS[@]}" || exit 1
    rm -rf "$CARRY/wheels" "$CARRY/sdist"  # no older version left beside the new ones
    mv "$CARRY/new/wheels" "$CARRY/new/sdist" "$CARRY/" && rmdir "$CARRY/new" || exit 1
    model=$(.venv/bin/python -c "from handler.model_source.default_model import \
ensure_default_model; print(ensure_default_model())") || exit 1
    cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/chat_template.jinja \
        "$CARRY/tokenizer/" || exit 1
    echo "carried: ${WHEELS[*]} ${SDISTS[*]}"
    du -sh "$CARRY"
    exit 0
fi

OUT=${OUT:-/tmp/gpu-check}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
PRESETS=${PRESETS:-llama-1b}
CHECKS=" ${CHECKS:-tests profile} "
mkdir -p "$OUT"
: > "$OUT/summary.txt"
: > "$OUT/log.txt"
if ls "$CARRY"/wheels/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-check-site "$CARRY"/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/gpu-check-site:$PWD
    ls "$CARRY"/sdist/*.tar.gz > /dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps \
        --no-build-isolation --no-cache-dir --target /tmp/gpu-check-site "$CARRY"/sdist/*.tar.gz \
        >> "$OUT/log.txt" 2>&1 || echo "gunicorn-h1c not built: gunicorn's Python parser" \
        >> "$OUT/summary.txt"
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run it, log it, one line in the summary
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "===== $name: $*" >> "$OUT/log.txt"
    timeout "$limit" "$@" >> "$OUT/log.txt" 2>&1
    rc=$?
    echo "$name: rc=$rc in $(( $(date +%s) - start )) s" >> "$OUT/summary.txt"
    return "$rc"
}

want() { [[ "$CHECKS" == *" $1 "* ]]; }

step env 30 "$PY" -c "
import torch, transformers, tokenizers, llguidance, flask
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
print('transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory >> 20, 'MiB')
"
# The CUDA cases the suite skips on CPU: async scheduling with and without graphs, graphs
# (whole-step and piecewise) captured, checked and exact per strategy, every strategy and backend against generate,
# FlexAttention against the reference in bf16 (and where a window slid past more pages than
# the pool holds) and compiled at start-up, and nothing compiled
# in served steps after it (the sweeps' stalls, found on CPU); the Triton paged attention kernel
# compiled against dense attention, and an engine through it with graphs against generate.
want tests && step cuda-tests 240 "$PY" -m pytest -q -rs -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} \
    "tests/test_async_scheduling.py::test_planned_ahead_on_cuda_gives_generate_greedy_tokens" \
    "tests/test_padded_decode.py::test_cuda_graphs_are_captured_checked_and_exact" \
    "tests/test_piecewise.py::test_piecewise_cuda_graphs_are_captured_checked_and_exact" \
    "tests/test_equivalence.py::test_greedy_matches_transformers_generate_on_gpu" \
    "tests/test_attention_backends.py::test_flex_matches_reference_on_gpu_bf16" \
    "tests/test_attention_backends.py::test_flex_on_gpu_compiles_at_start_up_not_while_serving" \
    "tests/test_attention_backends.py::test_a_window_slid_past_more_pages_than_the_pool_holds" \
    "tests/test_attention_warm_up.py::test_served_steps_compile_nothing_in_a_fresh_process[cuda]" \
    "tests/test_attention_triton.py::test_compiled_kernel_on_cuda_matches_dense_attention" \
    "tests/test_attention_triton.py::test_cuda_engine_with_graphs_gives_generate_greedy_tokens" \
    "tests/test_triton_ops.py::test_compiled_ops_pass_their_check_on_cuda" \
    "tests/test_lora.py::test_lora_on_cuda_with_graphs_gives_peft_tokens" \
    "tests/test_triton_wq.py" \
    "tests/test_quant_checkpoints.py::test_cuda_fast_paths_pass_their_check_and_serve_the_emulated_tokens" \
    "tests/test_disaggregated.py::test_cuda_workers_give_transformers_greedy_tokens"
want tests && grep -E "[0-9]+ (passed|failed|skipped|errors?)" "$OUT/log.txt" | tail -1 \
    >> "$OUT/summary.txt"

tokenizer=$CARRY/tokenizer
if [ ! -f "$tokenizer/tokenizer.json" ]; then  # a rehearsal without --fetch: the tests' tiny BPE
    tokenizer=/tmp/gpu-check-tiny
    "$PY" -c "from pathlib import Path; from tests.models_fixtures import build_tiny_model; \
build_tiny_model(Path('$tokenizer'))" >> "$OUT/log.txt" 2>&1
fi
dtype=bfloat16
[ "$DEVICE" = cpu ] && dtype=float32
rm -rf /tmp/gpu-check-model-*
random_model() {  # random_model PRESET: sets $model, its folder, built once per run
    model=/tmp/gpu-check-model-$1
    [ -f "$model/.built" ] && return
    rm -rf "$model"
    step "model-$1" 90 "$PY" -m handler.cli bench random-model "$model" --preset "$1" \
        --tokenizer-from "$tokenizer" --dtype "$dtype" --device "$DEVICE" && touch "$model/.built"
}
first=${PRESETS%% *}  # the one served and swept too: kept until the end
for preset in $PRESETS; do
    want profile || break
    random_model "$preset"
    for async in true false; do
        step "profile-$preset-async-$async" 100 "$PY" -m handler.cli bench profile \
            --model-dir "$model" --device "$DEVICE" --dtype "$dtype" --async-scheduling "$async" \
            --out "$OUT/profile-$preset-async-$async"
    done
    [ "$preset" = "$first" ] || rm -rf "$model"  # a 7B folder is ~13 GB
done
wait_ping() {  # wait_ping STEP PORT: until the server on PORT answers /ping (a step, 150 s)
    step "$1" 150 "$PY" -c "
import time, urllib.request
while True:
    try:
        urllib.request.urlopen('http://127.0.0.1:$2/ping', timeout=2)
        break
    except OSError:
        time.sleep(1)"
}
served() {  # served MODEL COUNT: serve it with api_server_count=COUNT, load it, stop it
    local props=/tmp/gpu-check-served-$2.properties port=$((8090 + $2)) pid
    printf "option.rolling_batch=paged\noption.max_rolling_batch_size=128\n\
option.max_model_len=512\noption.dtype=%s\noption.device=%s\njob_queue_size=256\n\
option.api_server_count=%s\n" "$dtype" "$DEVICE" "$2" > "$props"
    "$PY" -m handler.cli serve --properties "$props" --model-dir "$1" --host 127.0.0.1 \
        --port "$port" >> "$OUT/log.txt" 2>&1 &
    pid=$!
    wait_ping "served-ping-$2" "$port"
    step "served-api-server-count-$2" 90 "$PY" -m benchmark.tools.raw_client --port "$port" \
        --model-dir "$1" -n "${SERVED_REQUESTS:-1280}" -c 128
    grep "req/s;" "$OUT/log.txt" | tail -1 | sed "s/^/api_server_count=$2: /" >> "$OUT/summary.txt"
    kill -TERM "$pid"
    wait "$pid"
}
if want served; then
    random_model "$first"
    served "$model" 1
    served "$model" 2
fi
if want wide; then  # graphs against eager steps at longer contexts: the graphs' KV gather
    random_model "$first"  # grows with rows x context, an eager step's attention does not
    for tokens in ${WIDE_PROMPTS:-200 1000}; do
        for eager in "" --enforce-eager; do
            name=wide-$tokens${eager:+-eager}
            step "$name" 150 "$PY" -m handler.cli bench profile --model-dir "$model" --device \
                "$DEVICE" --dtype "$dtype" --batch-sizes 8,32 --prompt-tokens "$tokens" $eager \
                --out "/tmp/gpu-check-wide/$name"
            "$PY" - "/tmp/gpu-check-wide/$name/profile.json" "$name" >> "$OUT/summary.txt" \
                2>> "$OUT/log.txt" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"{sys.argv[2]}: {r['kind']} batch {r['batch']} tokens {r['tokens']} step "
          f"{r['step_ms']:.2f} ms busy {r['device_busy_ms']} graphs {r['graph_share']:.0%}")
EOF
        done
    done
fi
if want kernels; then  # #51: each attention backend's steps against the hardware floor
    random_model "$first"
    rm -rf /tmp/gpu-check-kernels  # a failed profile must not report an older run's rows
    for tokens in ${KERNEL_PROMPTS:-200 1000}; do
        for backend in ${KERNEL_BACKENDS:-triton flex}; do
            name=kernels-$tokens-$backend
            step "$name" 110 "$PY" -m handler.cli bench profile --model-dir "$model" --device \
                "$DEVICE" --dtype "$dtype" --batch-sizes "${KERNEL_BATCHES:-8,32}" \
                --steps "${KERNEL_STEPS:-20}" --prompt-tokens "$tokens" \
                --attention-backend "$backend" ${KERNEL_HBM:+--hbm-bandwidth "$KERNEL_HBM"} \
                --out "/tmp/gpu-check-kernels/$name"
            cp "/tmp/gpu-check-kernels/$name/profile.json" "$OUT/$name.json" 2> /dev/null
            "$PY" - "$OUT/$name.json" "$name" >> "$OUT/summary.txt" 2>> "$OUT/log.txt" <<'EOF'
import json, sys
run = json.load(open(sys.argv[1]))
def cell(value, digits):
    return "-" if value is None else f"{value:.{digits}f}"
for r in run["rows"]:
    print(f"{sys.argv[2]}: {run['attention_backend']} {r['kind']} batch {r['batch']} tokens "
          f"{r['tokens']} step {r['step_ms']:.3f} ms busy {cell(r['device_busy_ms'], 3)} ms "
          f"floor {cell(r['floor_ms'], 3)} ms ratio {cell(r['floor_ratio'], 2)} "
          f"graphs {r['graph_share']:.0%}")
EOF
        done
    done
fi
if want stall; then  # a long prompt admitted beside running decodes, graphs against eager
    random_model "$first"  # (its 512-token chunks pass the whole-step graphs' gather bound)
    mkdir -p /tmp/gpu-check-stall
    for mode in graphs eager; do
        { cat serving.properties.d/paged.properties
          echo "option.device=$DEVICE"; echo "option.dtype=$dtype"
          [ "$mode" = eager ] && echo "option.enforce_eager=true"; } \
            > "/tmp/gpu-check-stall/paged-$mode.properties"
    done
    step stall 200 "$PY" -m handler.cli bench stall /tmp/gpu-check-stall/paged-graphs.properties \
        /tmp/gpu-check-stall/paged-eager.properties --model-dir "$model" \
        --long-prompt-tokens "${STALL_PROMPT:-2000}" --out /tmp/gpu-check-stall
    grep -E "^paged-(graphs|eager): long prompt" "$OUT/log.txt" >> "$OUT/summary.txt"
fi
if want peers; then  # #51: transformers' continuous batching on the same card, model and KV
    random_model "$first"
    rm -rf /tmp/gpu-check-peers
    step peers 280 "$PY" -m handler.cli bench peers batchyard hf-cb --model-dir "$model" \
        --dtype "$dtype" --peer-device "$DEVICE" --kv-cache-memory "${PEERS_KV:-512MiB}" \
        -c 32 -n "${PEERS_REQUESTS:-96}" --out /tmp/gpu-check-peers
    cp /tmp/gpu-check-peers/peers.json "$OUT/peers.json" 2> /dev/null
    "$PY" - /tmp/gpu-check-peers/peers.json >> "$OUT/summary.txt" 2>> "$OUT/log.txt" <<'EOF'
import json, sys
from benchmark.tables import VLLM_PUBLISHED
runs = json.load(open(sys.argv[1]))
for name, run in runs.items():
    print(f"peers {name}: {run.get('requests_per_s', 0.0):.3f} req/s, "
          f"{run.get('num_errors')} errors, KV {run.get('kv_cache_bytes')} bytes = "
          f"{run.get('kv_tokens')} tokens, on {run.get('device')}" + (
              f"; failed: {run['error'][:200]}" if "error" in run else ""))
ours, theirs = (runs.get(n, {}).get("requests_per_s") for n in ("batchyard", "hf-cb"))
if ours and theirs:
    print(f"peers batchyard (offline) / hf-cb: {ours / theirs:.2f}x req/s (#51's target: 1.5x, served)")
print(f"peers {VLLM_PUBLISHED['name']}: published, not measured here: "
      f"{VLLM_PUBLISHED['figure']}; {VLLM_PUBLISHED['source']}")
EOF
fi
if want quant; then  # #53: bf16 / int8 / int4 (W4A16, Triton GEMM) / fp8 (_scaled_mm) on one card
    random_model "$first"
    rm -rf /tmp/gpu-check-quant
    step quant 240 "$PY" -m handler.cli bench quant --model-dir "$model" --device "$DEVICE" \
        --dtype "$dtype" --out /tmp/gpu-check-quant
    cp /tmp/gpu-check-quant/quant.json "$OUT/quant.json" 2> /dev/null
    "$PY" - "$OUT/quant.json" >> "$OUT/summary.txt" 2>> "$OUT/log.txt" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"quant {r['variant']}: " + (f"failed: {r['error'][:200]}" if "error" in r else
          f"{r['linear_bytes'] / 2**20:.0f} MiB linear ({r['ratio_to_bf16']:.2f}x bf16), decode "
          f"b1 {r['decode_b1_tokens_per_s']} b32 {r['decode_b32_tokens_per_s']} tok/s, "
          f"{r['requests_per_s']} req/s, layers {r.get('layers')}"))
EOF
fi
if want spec; then  # #54: n-gram speculation on the card (a random model proposes little:
    random_model "$first"  # this measures what verifying costs more than what it gains)
    rm -rf /tmp/gpu-check-spec
    step spec 240 "$PY" -m handler.cli bench spec --model-dir "$model" --device "$DEVICE" \
        --dtype "$dtype" --concurrency 1,4,32 --out /tmp/gpu-check-spec
    cp /tmp/gpu-check-spec/spec.json "$OUT/spec.json" 2> /dev/null
    "$PY" - "$OUT/spec.json" >> "$OUT/summary.txt" 2>> "$OUT/log.txt" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"spec {r['workload']} c{r['concurrency']} {'ngram' if r['speculation'] else 'off'}: "
          f"{r['output_tokens_per_s']} tok/s, {r['ms_per_token_mean']} ms/token, "
          f"acceptance {r.get('acceptance_rate')}")
EOF
fi
if want disagg; then  # #55: TTFT of one 4,000-token prompt, colocated and 1 / 2 prefill workers
    random_model "$first"  # (workers split the one card by processes, KV staged through the host)
    rm -rf /tmp/gpu-check-disagg
    step disagg 240 "$PY" -m handler.cli bench runahead --model-dir "$model" --device "$DEVICE" \
        --dtype "$dtype" --prompt-tokens "${RUNAHEAD_TOKENS:-4000}" --out /tmp/gpu-check-disagg
    cp /tmp/gpu-check-disagg/runahead.json "$OUT/runahead.json" 2> /dev/null
    cat /tmp/gpu-check-disagg/runahead.md >> "$OUT/summary.txt" 2> /dev/null
    # goodput of 1 + 1 workers splitting the card by processes against paged on all of it
    P=serving.properties.d
    step goodput 240 "$PY" -m handler.cli bench goodput --model-dir "$model" \
        --properties "$P/paged.properties" "$P/disaggregated.properties" \
        --set "option.dtype=$dtype" --set "option.device=$DEVICE" --set option.max_model_len=2048 \
        --rates "${GOODPUT_RATES:-4,8,16,32}" --requests 48 --ttft-slo 500 --tpot-slo 50 \
        --out /tmp/gpu-check-disagg/goodput
    cp /tmp/gpu-check-disagg/goodput/goodput.json "$OUT/goodput.json" 2> /dev/null
    head -12 /tmp/gpu-check-disagg/goodput/goodput.md >> "$OUT/summary.txt" 2> /dev/null
fi
if want sweep; then  # the README's GPU table: LMI workload, 32 clients, one KV budget for all
    random_model "$first"
    rm -rf /tmp/gpu-check-sweep
    P=serving.properties.d
    for kv in ${SWEEP_KV:-2GiB 512MiB}; do
        files=("$P/paged.properties" "$P/continuous.properties" "$P/dynamic.properties")
        # TORCH_LOGS: why a compiled graph recompiles while serving (the slow-step warnings
        # say when one did)
        TORCH_LOGS=recompiles step "sweep-kv-$kv" 200 "$PY" -m handler.cli bench sweep "${files[@]}" --model-dir "$model" \
            --set "option.dtype=$dtype" --set "option.device=$DEVICE" --kv-cache-memory "$kv" \
            -c 32 -n "${SWEEP_REQUESTS:-96}" --out "/tmp/gpu-check-sweep/kv-$kv"
        cp "/tmp/gpu-check-sweep/kv-$kv/sweep.json" "$OUT/sweep-kv-$kv.json" 2> /dev/null
        "$PY" - "$OUT/sweep-kv-$kv.json" "$kv" >> "$OUT/summary.txt" 2>> "$OUT/log.txt" <<'EOF'
import json, sys
for name, run in json.load(open(sys.argv[1])).items():
    step_ms = 1000 * (run.get("server") or {}).get("mean_step_s", 0.0)
    # Stalls every running stream sees at once (the 11-26 run had 0.2-0.6 s ones)
    gaps = [g for g in run.get("samples", {}).get("inter_token", []) if g > 0.1]
    print(f"kv {sys.argv[2]} {name}: {run.get('requests_per_s', 0.0):.3f} req/s, "
          f"{run.get('num_errors')} errors, server step {step_ms:.1f} ms, "
          f"{len(gaps)} token gaps > 100 ms (longest {max(gaps, default=0):.2f} s)")
EOF
    done
    tar -czf "$OUT/sweep-logs.tar.gz" -C /tmp/gpu-check-sweep . 2> /dev/null
    grep -hE "heap frozen|tokenizer view built" /tmp/gpu-check-sweep/*/*.server.log | sed -E 's/^[0-9-]+ [0-9:,]+ //' \
        >> "$OUT/summary.txt"
    # Slow steps and recompiles once serving (engine/observe/step_watch.py): none expected since
    # 11db9b8; the warm-up's own recompiles come before "model loaded"
    for log in /tmp/gpu-check-sweep/*/*.server.log; do
        awk '/model loaded in/{on=1} on' "$log" | grep -E "slow engine step|Recompiling|    - " | \
            grep -v "size mismatch" | head -8 | cut -c1-900 | \
            sed "s|^|$(basename "$(dirname "$log")")/$(basename "$log" .server.log): |"
    done >> "$OUT/summary.txt"
fi
ratio_served() {  # ratio_served NAME MODEL PROPERTIES SERVER_CPUS CLIENT_CPUS N "CLIENTS...":
    local port=8110 pid server=() client=() clients  # one round per entry of CLIENTS
    [ -n "$4" ] && server=(taskset -c "$4")
    [ -n "$5" ] && client=(taskset -c "$5")
    OMP_NUM_THREADS=1 "${server[@]}" "$PY" -m handler.cli serve --properties "$3" \
        --model-dir "$2" --host 127.0.0.1 --port "$port" >> "$OUT/log.txt" 2>&1 &
    pid=$!
    wait_ping "ratio-$1-ping" "$port"
    for clients in $7; do
        MODEL=$2 step "ratio-$1-c$clients" 60 "${client[@]}" "$PY" -m benchmark.tools.measure "$port" "$6" \
            "$clients" && grep "req/s | batch" "$OUT/log.txt" | tail -1 | \
            sed "s/^/$1, $clients clients: /" >> "$OUT/summary.txt"
    done
    kill -TERM "$pid"
    wait "$pid"
}
ratio_offline() {  # ratio_offline NAME MODEL PROPERTIES DTYPE CPUS N ROUNDS
    local cpus=() round
    [ -n "$5" ] && cpus=(taskset -c "$5")
    for round in $(seq "$7"); do
        OMP_NUM_THREADS=1 MODEL=$2 DTYPE=$4 step "ratio-$1-$round" 90 "${cpus[@]}" "$PY" \
            -m benchmark.tools.offline "$3" "$6" && grep "^offline .* req/s" "$OUT/log.txt" | tail -1 | \
            sed "s/^/$1: /" >> "$OUT/summary.txt"
    done
}
if want ratio; then  # #17's served/offline ratio (24 + 64 tokens, 32 clients) off a full host
    R=docs/benchmark/cpu-2026-11-26-direct-streams
    if [ "${RATIO_CPU:-1}" = 1 ]; then  # RATIO_CPU=0: the GPU part alone (~4 min)
        step tiny-model 60 "$PY" -c "from pathlib import Path; from tests.models_fixtures \
import build_tiny_model; build_tiny_model(Path('/tmp/tiny320'))"
        # The CPU target's run (device=cpu: auto would take the GPU): the server on 2 cores,
        # the load generator on 2 others and then on the server's
        props=/tmp/gpu-check-ratio-cpu.properties
        { cat "$R/paged.properties"; echo "option.device=cpu"; } > "$props"
        ratio_offline cpu-offline /tmp/tiny320 "$props" float32 0,1 2560 2
        ratio_served cpu-served-client-off-its-cores /tmp/tiny320 "$props" 0,1 2,3 2560 \
            "32 32 32"
        ratio_served cpu-served-client-on-its-cores /tmp/tiny320 "$props" 0,1 0,1 2560 "32 32"
    fi
    if [ "$DEVICE" != cpu ]; then  # the first preset on the GPU, the host's cores unpinned
        random_model "$first"
        props=/tmp/gpu-check-ratio-gpu.properties
        { sed -e "s/float32/$dtype/" "$R/paged.properties"; echo "option.device=$DEVICE"; } \
            > "$props"
        ratio_offline gpu-offline "$model" "$props" "$dtype" "" 1280 "${OFFLINE_ROUNDS:-2}"
        # 40 clients: a request waiting whenever a slot frees, so the HTTP round trip
        # between one request's end and the next one's start leaves no slot empty
        ratio_served gpu-served "$model" "$props" "" "" 1280 "${GPU_CLIENTS:-32 32 40 40}"
    fi
fi
rm -rf /tmp/gpu-check-model-*
# The device returns at most 8 files: with several presets, the JSON profiles alone.
[ "$(find "$OUT" -type f | wc -l)" -gt 8 ] && find "$OUT" -name profile.md -delete
# What the start-up checks decided (graphs, async scheduling, attention): each says why it fell
# back, if it did.
grep -iE "fall(s|ing)? back|disagree|differ|graphs? (on|off|captured)|piecewise|asynchronous scheduling|\
attention backend|heap frozen|tokenizer view built|HTTP parser" "$OUT/log.txt" | sed -E 's/^[0-9-]+ [0-9:,]+ //' | sort | uniq -c | head -40 \
    >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
