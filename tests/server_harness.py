"""Start the real `batchyard serve` (gunicorn) on loopback for HTTP tests; always stop it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from benchmark.servers import free_port, server_process

# The Dockerfile's ENTRYPOINT + CMD; tests/test_dockerfile.py checks they agree.
SERVER_ARGV_PREFIX = ["batchyard", "serve"]
BIN_DIR = Path(sys.executable).parent


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str) -> float:
        """Sum of a metric's samples from /metrics: all labels, or those in `name{k="v"}`."""
        text = requests.get(f"{self.url}/metrics", timeout=5).text
        if "{" in name:
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + " "))
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and line[len(name)] in " {")

    def wait_metric(self, name: str, value: float, timeout: float = 10.0) -> None:
        """Wait until metric(name) == value: a stream's request thread counts it after the
        stream's last bytes are out, so a client that has read them may scrape before that."""
        end = time.monotonic() + timeout
        while (seen := self.metric(name)) != value:
            assert time.monotonic() < end, f"{name} is {seen}, not {value}"
            time.sleep(0.02)


def server_argv(model_dir: Path | None, properties: Path, port: int) -> list[str]:
    """The server command; model_dir None serves the embedded default model."""
    exe = str(BIN_DIR / SERVER_ARGV_PREFIX[0])
    model = ["--model-dir", str(model_dir)] if model_dir is not None else []
    return [exe, *SERVER_ARGV_PREFIX[1:], *model, "--properties", str(properties), "--host",
            "127.0.0.1", "--port", str(port)]


@contextlib.contextmanager
def running_server(tmp_path: Path, model_dir: Path | None, properties: str, env: dict | None = None,
                   wait_ready: bool = True, timeout: float = 90) -> Iterator[Server]:
    """Yields a Server once /ping answers 200 (or at once with wait_ready=False)."""
    props = tmp_path / f"serving-{time.monotonic_ns()}.properties"
    props.write_text(properties)
    port = free_port()
    log_path = props.with_suffix(".log")
    argv = server_argv(model_dir, props, port)
    with server_process(argv, log_path, env) as process:
        server = Server(f"http://127.0.0.1:{port}", process, log_path)
        if wait_ready:
            wait_for_ping(server, timeout)
        yield server


def first_answer(url: str, timeout: float) -> requests.Response:
    """The first HTTP answer from `url` once the server accepts connections."""
    end = time.monotonic() + timeout
    while True:
        try:
            return requests.get(url, timeout=2)
        except requests.ConnectionError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def wait_for_ping(server: Server, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{server.url}/ping", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"server not ready in {timeout} s:\n{server.log()}")
