"""One engine core behind several serving processes (option.api_server_count).

One serving process streams at most what its one GIL can format and write (~10k tokens/s at
~90 us of request-thread, detokenizing and JSON work per token), whatever the device could do.
With N serving processes (gunicorn workers), each connects to one core process over a Unix
socket, the way vLLM's API servers share one engine core: the core takes requests from all of
them, sends each step's token ids to the process that asked for them, and stops when the last
one has left (or the process that started it is gone).

The starting process (gunicorn's master) calls start_core_server(); each serving process builds
an EngineClient.connect() on the address it returns."""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

LISTEN_WAIT_SECONDS = 120.0  # how long the starting process waits for the core's socket
PARENT_CHECK_SECONDS = 0.5
_LOG_FORMAT = "%(asctime)s %(levelname)s engine-core %(name)s: %(message)s"


@dataclass(frozen=True)
class CoreAddress:
    """Where serving processes connect, and the key that proves they are ours."""

    path: str
    authkey: bytes


@dataclass(frozen=True)
class _Setup:
    config: EngineConfig  # imported for type checking only: this module stays free of torch
    address: CoreAddress
    prepare: Callable[[], object] | None  # e.g. build the default model: runs before loading
    log_level: int


class CoreServer:
    """The core process, seen from the process that started it."""

    def __init__(self, config: EngineConfig,
                 prepare: Callable[[], object] | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="batchyard-core-")  # 0700: ours alone
        self.address = CoreAddress(str(Path(self._dir) / "core.sock"), secrets.token_bytes(32))
        setup = _Setup(config, self.address, prepare, logging.getLogger().getEffectiveLevel())
        # A fresh interpreter, not a multiprocessing child: gunicorn forks its workers from this
        # process, and each would inherit (and try to join at exit) a multiprocessing child.
        # It imports what this process can (sys.path), as multiprocessing's spawn does.
        start = (f"import sys; sys.path[:0] = {sys.path!r}; "
                 "from engine.core.server import main; main()")
        self._process = subprocess.Popen([sys.executable, "-c", start], stdin=subprocess.PIPE)
        assert self._process.stdin is not None  # stdin=PIPE
        self._process.stdin.write(pickle.dumps(setup))
        self._process.stdin.close()
        logger.info("engine core process %d started; serving processes connect to it in %s",
                    self._process.pid, self._dir)

    def scratch_dir(self, name: str) -> str:
        """A folder of the core's private directory, removed with it (e.g. the HTTP workers'
        metrics files)."""
        path = Path(self._dir) / name
        path.mkdir()
        return str(path)

    def wait_listening(self, timeout: float = LISTEN_WAIT_SECONDS) -> None:
        """Block until serving processes can connect; raises RuntimeError if the core exited."""
        end = time.monotonic() + timeout
        while not os.path.exists(self.address.path):
            if self._process.poll() is not None or time.monotonic() > end:
                raise RuntimeError("the engine core process did not start (see its log)")
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        """After the serving processes left, the core exits by itself; make sure of it. Safe to
        call more than once."""
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("engine core process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def _exit_with_parent(parent: int, socket_path: str) -> None:
    """The server that started us is gone (killed, or it never reached its exit hook): stop,
    even while the model still loads, rather than hold its memory and device, and remove the
    private directory it would have."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_SECONDS)
    logger.warning("engine core: the server process is gone; exiting")
    shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)
    logging.shutdown()
    os._exit(1)


def main() -> None:
    """The core process: listen, prepare and load the model, then serve every front."""
    setup: _Setup = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=setup.log_level, format=_LOG_FORMAT)
    for signum in (signal.SIGINT, signal.SIGTERM):  # the fronts stop us, after their drain
        signal.signal(signum, signal.SIG_IGN)
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent, setup.address.path),
                     name="parent-watch", daemon=True).start()
    listener = Listener(setup.address.path, "AF_UNIX", backlog=64,
                        authkey=setup.address.authkey)
    from engine.core.engine_core import (  # torch: once the socket is there
        EngineCore,
        prepare_to_serve,
    )
    from engine.core.fronts import Fronts
    from engine.core.process import CoreFailed, CoreReady
    from engine.llm_engine import LLMEngine

    fronts = Fronts(listener)

    try:
        if setup.prepare is not None:
            setup.prepare()
        engine = LLMEngine.from_config(setup.config)
    except Exception as err:
        fronts.open(CoreFailed.of(err))
        raise SystemExit(1) from None
    prepare_to_serve(engine)
    fronts.open(CoreReady.of(engine))
    EngineCore(engine, fronts.receive, fronts.publish).run()
    listener.close()
    if os.getppid() != parent:  # the workers left because the server was killed: clean up
        shutil.rmtree(os.path.dirname(setup.address.path), ignore_errors=True)
