"""Start `batchyard serve` on a free loopback port for a benchmark run, and always stop it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from benchmark.loadgen import wait_ready


class ServerStartError(RuntimeError):
    """The server exited or never became ready; the message carries its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(argv: list[str], log_path: Path,
                   env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Runs `argv` with output to `log_path`; on exit SIGTERM (the server drains), then kill."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def local_server(properties: Path, log_path: Path, model_dir: Path | None = None,
                 ready_timeout: float = 600.0, env: dict[str, str] | None = None) -> Iterator[str]:
    """Yields the base URL of a ready server started with `properties`; stops it on exit."""
    port = free_port()
    # `-m`, not the console script: a GPU machine's python may hold our tree on PYTHONPATH only
    argv = [sys.executable, "-m", "handler.cli", "serve", "--properties",
            str(properties), "--host", "127.0.0.1", "--port", str(port)]
    if model_dir is not None:
        argv += ["--model-dir", str(model_dir)]
    url = f"http://127.0.0.1:{port}"
    with server_process(argv, log_path, env) as process:
        _wait(process, url, ready_timeout, log_path)
        yield url


def _wait(process: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    """Ready, or ServerStartError as soon as the process exits or the timeout passes."""
    step = 1.0
    waited = 0.0
    while waited < timeout:
        if process.poll() is not None:
            raise ServerStartError(f"server exited with code {process.returncode} before it was "
                                   f"ready; log {log_path}:\n{_tail(log_path)}")
        try:
            wait_ready(url, step)
            return
        except TimeoutError:
            waited += step
    raise ServerStartError(f"server not ready within {timeout:.0f} s; log {log_path}:\n"
                           f"{_tail(log_path)}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
