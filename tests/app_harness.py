"""A Flask test client over a real tiny engine (a core thread, no gunicorn): fast HTTP tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from flask.testing import FlaskClient

from engine import EngineClient
from handler.config.serving_config import ServingConfig
from handler.http.app import create_app
from handler.http.state import ServerState
from tests.engine_harness import make_engine


@contextlib.contextmanager
def served_app(model_dir: Path, batching: str = "continuous", max_queued: int = 8,
               **config) -> Iterator[tuple[FlaskClient, ServerState]]:
    """(test client, state) of an app serving `model_dir`; the engine is shut down after."""
    engine = make_engine(model_dir, batching)
    state = ServerState(ServingConfig(engine=engine.config, job_queue_size=max_queued,
                                      engine_process=False, **config))
    state.serve(EngineClient(engine, max_queued, state.metrics.on_step))
    try:
        yield create_app(state).test_client(), state
    finally:
        state.shutdown(grace_seconds=0.0)
