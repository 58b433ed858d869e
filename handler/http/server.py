"""gunicorn: ONE worker (the model is loaded once) with many threads; the engine loop and the
model loader run as background threads of that worker."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

from gunicorn.app.base import BaseApplication

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

    def __init__(self, make_state: Callable[[], ServerState], options: dict) -> None:
        self._make_state = make_state
        self._options = options
        self.state: ServerState | None = None
        super().__init__()

    def load_config(self) -> None:
        for key, value in self._options.items():
            self.cfg.set(key, value)
        self.cfg.set("worker_exit", self._on_worker_exit)

    def load(self):
        # Runs inside the worker after fork: load the model there, in the background.
        self.state = self._make_state()
        self.state.start_loading()
        return create_app(self.state)

    def _on_worker_exit(self, server, worker) -> None:
        # The worker drained on SIGTERM (a no-op now); on any other exit, end what is left.
        if self.state is not None:
            self.state.shutdown(grace_seconds=0.0)


def run_server(make_state: Callable[[], ServerState], host: str, port: int,
               threads: int = 128, drain_seconds: float = 30.0) -> None:
    """Serve until SIGTERM/SIGINT (exit 0) or a failed model load (exit 3)."""
    options = {
        "bind": f"{host}:{port}", "workers": 1, "worker_class": JsonErrorWorker,
        "threads": threads, **HEADER_LIMITS,
        "worker_connections": max(1000, threads + 64),
        # The gthread worker's main loop heartbeats while requests run: long generations are
        # never killed by this timeout.
        "timeout": 120, "keepalive": 5,
        "graceful_timeout": math.ceil(drain_seconds) + WRITE_OUT_SECONDS,
        "loglevel": "info", "accesslog": None, "proc_name": "batchyard",
    }
    logger.info("listening on http://%s:%d (1 worker, %d threads)", host, port, threads)
    GunicornServer(make_state, options).run()


def exit_on_load_failure() -> None:
    """Stop the whole server so that an orchestrator restarts it (gunicorn exits with 3)."""
    logging.shutdown()
    os._exit(WORKER_BOOT_ERROR)


def exit_on_engine_death() -> None:
    """The engine died while serving: stop the whole server the same way (exit 3)."""
    exit_on_load_failure()
