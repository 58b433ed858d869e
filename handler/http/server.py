"""gunicorn: one worker with many threads, the engine loop and the model loader running as
background threads of it; or, with option.api_server_count=N, N such workers that share one
engine core process started before them (the model is loaded once either way)."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Callable

from gunicorn.app.base import BaseApplication
from gunicorn.errors import HaltServer

from handler.http.app import create_app
from handler.http.state import ServerState
from handler.http.worker import HEADER_LIMITS, JsonErrorWorker

logger = logging.getLogger(__name__)

WORKER_BOOT_ERROR = 3  # gunicorn's master halts with this code when its worker exits with it
# After the drain (option.drain_timeout), how long gunicorn may take to write the last answers
# before its master kills the worker.
WRITE_OUT_SECONDS = 10


class GunicornServer(BaseApplication):
    """Runs create_app(ServerState) in one gthread worker."""

    def __init__(self, make_state: Callable[[], ServerState], options: dict,
                 on_exit: Callable[[], None] | None = None) -> None:
        self._make_state = make_state
        self._options = options
        self._on_exit = on_exit  # in the master, after the workers left
        self.state: ServerState | None = None
        super().__init__()

    def load_config(self) -> None:
        for key, value in self._options.items():
            self.cfg.set(key, value)
        self.cfg.set("worker_exit", self._on_worker_exit)
        if self._on_exit is not None:
            self.cfg.set("on_exit", lambda server: self._on_exit())
        if self._options["workers"] > 1:
            self.cfg.set("child_exit", _forget_metrics_of)

    def load(self):
        # Runs inside the worker after fork: load the model there, in the background.
        self.state = self._make_state()
        self.state.start_loading()
        return create_app(self.state)

    def _on_worker_exit(self, server, worker) -> None:
        # The worker drained on SIGTERM (a no-op now); on any other exit, end what is left.
        if self.state is not None:
            self.state.shutdown(grace_seconds=0.0)


def _forget_metrics_of(server, worker) -> None:
    """A worker exited: its live gauges leave /metrics (prometheus_client's multiprocess mode)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def run_server(make_state: Callable[[], ServerState], host: str, port: int,
               threads: int = 128, drain_seconds: float = 30.0, workers: int = 1,
               on_exit: Callable[[], None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT (exit 0) or a failed model load (exit 3); `workers` > 1 share
    one engine core process, which `on_exit` stops."""
    options = gunicorn_options(host, port, threads, drain_seconds, workers)
    each = (f"{workers} workers, {threads} threads each" if workers > 1
            else f"1 worker, {threads} threads")
    logger.info("listening on http://%s:%d (%s), HTTP parser: %s", host, port, each,
                http_parser())
    try:
        GunicornServer(make_state, options, on_exit).run()
    except HaltServer as halt:
        # gunicorn's halt() reaps the other workers; one that failed to boot meanwhile (all
        # do when the model cannot load) raises HaltServer again, out of run(), and the
        # master would exit 1 with a trace: the same ending, with its status (3)
        logger.error("shutting down: %s", halt.reason)
        raise SystemExit(halt.exit_status) from None


def gunicorn_options(host: str, port: int, threads: int, drain_seconds: float,
                     workers: int) -> dict:
    """The gunicorn settings `batchyard serve` runs with."""
    return {
        "bind": f"{host}:{port}", "workers": workers, "worker_class": JsonErrorWorker,
        "threads": threads, **HEADER_LIMITS,
        "worker_connections": max(1000, threads + 64),
        # The gthread worker's main loop heartbeats while requests run: long generations are
        # never killed by this timeout.
        "timeout": 120, "keepalive": 5,
        "graceful_timeout": math.ceil(drain_seconds) + WRITE_OUT_SECONDS,
        "loglevel": "info", "accesslog": None, "proc_name": "batchyard",
        # gunicorn's C parser where gunicorn_h1c is installed (a pinned dependency), else its
        # Python one: the same requests, limits and errors, ~100 us less of a request
        # thread's CPU per request on a 2-vCPU host (docs/benchmark/cpu-2026-11-26-http-cpu/)
        "http_parser": "auto",
    }


def http_parser() -> str:
    """The HTTP/1.1 parser gunicorn runs with gunicorn_options() (`auto`), for the log."""
    if importlib.util.find_spec("gunicorn_h1c") is None:
        return "gunicorn's Python parser (gunicorn_h1c is not installed)"
    return "gunicorn_h1c (C)"


def exit_on_load_failure() -> None:
    """Stop the whole server so that an orchestrator restarts it (gunicorn exits with 3)."""
    logging.shutdown()
    os._exit(WORKER_BOOT_ERROR)


def exit_on_engine_death() -> None:
    """The engine died while serving: stop the whole server the same way (exit 3)."""
    exit_on_load_failure()
