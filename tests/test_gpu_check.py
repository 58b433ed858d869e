"""scripts/gpu_check.sh is run only where a GPU is lent, rarely: what it names must still exist,
or that session spends its device minutes on a typo."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_check.sh"


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_test_it_runs_is_collected() -> None:
    ids = re.findall(r'"(tests/test_\w+\.py::\w+)"', SCRIPT.read_text())
    assert len(ids) >= 5
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", *ids],
                            capture_output=True, text=True, cwd=SCRIPT.parent.parent)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    collected = result.stdout
    for node in ids:
        assert node in collected, f"{node} is not collected"


def test_every_bench_option_it_passes_exists() -> None:
    lines = SCRIPT.read_text().replace("\\\n", " ").splitlines()
    used: dict[str, set[str]] = {}
    for line in lines:  # every line that runs a command (a command runs on several lines)
        for command in ("random-model", "profile", "sweep", "peers"):
            if f"bench {command}" in line:
                flags = re.findall(r"(--[\w-]+)", line.split(f"bench {command}", 1)[1])
                used.setdefault(command, set()).update(flags)
    assert set(used) == {"random-model", "profile", "sweep", "peers"} and all(used.values())
    for command, flags in used.items():
        help_text = subprocess.run([sys.executable, "-m", "handler.cli", "bench", command, "-h"],
                                   capture_output=True, text=True, check=True,
                                   cwd=SCRIPT.parent.parent).stdout
        for flag in flags:
            assert flag in help_text, f"bench {command} has no {flag}"


def test_the_served_check_names_a_client_and_serve_options_that_exist() -> None:
    text = SCRIPT.read_text().replace("\\\n", " ")
    assert re.findall(r"(docs/\S+\.py)", text) == [], "scripts live in benchmark/tools/"
    tools = set(re.findall(r"-m benchmark\.tools\.(\w+)", text))
    assert {"raw_client", "measure", "offline"} <= tools
    for tool in tools:
        assert (SCRIPT.parent.parent / "benchmark" / "tools" / f"{tool}.py").is_file()
    serve_flags = set(re.findall(r"(--[\w-]+)", text.split("handler.cli serve", 1)[1]
                                 .split("\n", 1)[0]))
    assert {"--properties", "--model-dir", "--port"} <= serve_flags
    help_text = subprocess.run([sys.executable, "-m", "handler.cli", "serve", "-h"],
                               capture_output=True, text=True, check=True,
                               cwd=SCRIPT.parent.parent).stdout
    for flag in serve_flags:
        assert flag in help_text, f"batchyard serve has no {flag}"
    assert "option.api_server_count=%s" in text


def test_the_sweep_check_names_properties_files_that_exist() -> None:
    text = SCRIPT.read_text()
    names = set(re.findall(r"\$P/(\w+\.properties)", text))
    assert names == {"paged.properties", "continuous.properties", "dynamic.properties",
                     "disaggregated.properties"}
    for name in names:
        assert (SCRIPT.parent.parent / "serving.properties.d" / name).is_file()


def test_the_carried_packages_are_named_not_pinned_and_installed_here() -> None:
    """--fetch takes each carried package at the version this environment runs (from
    pyproject.toml's pins): no second list of versions in the script to drift."""
    text = SCRIPT.read_text()
    assert not re.findall(r"\b[A-Za-z][\w.-]*==\d", text)
    names = [name for group in ("WHEEL_NAMES", "SDIST_NAMES")
             for name in re.search(rf"^{group}=\(([^)]*)\)", text, re.M)[1].split()]
    assert {"transformers", "tokenizers", "gunicorn-h1c"} <= set(names)
    for name in names:
        assert importlib.metadata.version(name)


def test_every_check_it_knows_is_documented_in_its_header() -> None:
    """`want NAME` runs a part: its header says what CHECKS=NAME does (or that it is a default)."""
    text = SCRIPT.read_text()
    header = text.split("set -uo pipefail", 1)[0]
    checks = set(re.findall(r"\bwant (\w+)", text))
    assert {"tests", "profile", "sweep", "stall", "peers"} <= checks
    default = re.search(r'default "([\w ]+)"', header)[1].split()
    for name in checks - set(default):
        assert f"CHECKS={name}" in header, f"CHECKS={name} is not documented"


def test_the_kernels_check_profiles_triton_then_flex_within_a_device_call() -> None:
    """CHECKS=kernels: a profile per prompt length and attention backend (each one the engine
    knows), bounded so that they and the model fit a 600 s call; the CUDA tests include the
    Triton kernel's."""
    from engine.config import ATTENTION_BACKENDS

    text = SCRIPT.read_text()
    block = text.split("if want kernels; then", 1)[1].split("\nfi\n", 1)[0]
    backends = re.search(r"KERNEL_BACKENDS:-([\w ]+)\}", block)[1].split()
    prompts = re.search(r"KERNEL_PROMPTS:-([\d ]+)\}", block)[1].split()
    assert backends == ["triton", "flex"] and set(backends) <= set(ATTENTION_BACKENDS)
    assert '--attention-backend "$backend"' in block and "KERNEL_BATCHES:-8,32" in block
    limit = int(re.search(r'step "\$name" (\d+) ', block)[1])
    model_limit = int(re.search(r'step "model-\$1" (\d+) ', text)[1])
    env_limit = int(re.search(r"step env (\d+) ", text)[1])
    assert env_limit + model_limit + limit * len(backends) * len(prompts) <= 570
    for test in ("test_compiled_kernel_on_cuda_matches_dense_attention",
                 "test_cuda_engine_with_graphs_gives_generate_greedy_tokens"):
        assert f'"tests/test_attention_triton.py::{test}"' in text


def test_the_peers_check_runs_batchyard_against_hf_cb_on_one_budget() -> None:
    line = next(line for line in SCRIPT.read_text().replace("\\\n", " ").splitlines()
                if "bench peers" in line and not line.lstrip().startswith("#"))
    assert re.search(r"bench peers batchyard hf-cb ", line)
    assert "--kv-cache-memory" in line and '--peer-device "$DEVICE"' in line
