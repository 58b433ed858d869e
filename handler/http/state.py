"""ServerState: the model's life cycle (loading → ready | failed) shared by request threads."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine import AdapterError, CoreAddress, EngineClient, is_config_error
from handler.config.serving_config import ServingConfig
from handler.http.formatters import Formatters
from handler.http.metrics import Metrics
from handler.lmi.loader import load_custom_code
from handler.lmi.runner import HandlerRunner
from handler.model_source.adapters import startup_adapters

logger = logging.getLogger(__name__)

ENGINE_WATCH_SECONDS = 0.5  # how often a serving engine's liveness is checked
# After the engine dies, its requests in flight have ended with an error; this long is left
# for those answers to go out before on_engine_death stops the server.
ENGINE_DEATH_GRACE_SECONDS = 2.0


class ServerState:
    """Loads the engine in the background; answers readiness without ever blocking on it."""

    def __init__(self, config: ServingConfig, prepare_model: Callable[[], Path] | None = None,
                 on_load_failure: Callable[[], None] | None = None,
                 load_delay: float = 0.0,
                 on_engine_death: Callable[[], None] | None = None,
                 core_address: CoreAddress | None = None,
                 before_ready: Callable[[ServerState], None] | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.model_name = Path(config.engine.model).name
        self.status = "loading"
        self.started = int(time.time())  # OpenAI's `created` of the served model
        self.client: EngineClient | None = None
        self.runner: HandlerRunner | None = None  # a custom djl_python handler, if any
        self.formatters = Formatters(output_name=config.lmi.output_formatter)
        self._prepare_model = prepare_model
        self._on_load_failure = on_load_failure
        self._load_delay = load_delay  # test hook: makes the loading phase observable
        self._on_engine_death = on_engine_death
        # Set when several HTTP processes share one core process (option.api_server_count):
        # that process prepares and loads the model, this one connects to it.
        self._core_address = core_address
        self._all_started = False
        # Runs once loaded, before /ping says ready (the CLI freezes the start-up heap there).
        self._before_ready = before_ready

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="model-loader", daemon=True).start()

    def ready(self) -> bool:
        if self.status != "ready" or not self._all_workers_started():
            return False
        if self.runner is not None:
            return self.runner.alive()
        return self.client is not None and self.client.is_alive()

    def serves_core_process(self) -> bool:
        """Whether this process serves an engine core that runs in a process of its own."""
        return self.runner is None and self.client is not None and self.config.engine_process

    @property
    def engine(self) -> EngineClient:
        """The running engine; only called on paths that checked ready()."""
        assert self.client is not None, "the engine is not loaded"
        return self.client

    def serve(self, client: EngineClient) -> None:
        """Start serving through `client` (loaded by _load, or built by a test)."""
        self.client = client
        self.metrics.watch(client.gauges)
        client.start()
        if client.lora_enabled:
            self._register_folder_adapters(client)
        self._become_ready()
        if self._on_engine_death is not None:
            threading.Thread(target=self._watch_engine, name="engine-watch", daemon=True).start()

    def _register_folder_adapters(self, client: EngineClient) -> None:
        """<model dir>/adapters/<name>/ not registered yet: those of an s3:// model, there
        only once it is downloaded (a local model's came with the configuration). A refused
        one fails the load, naming it and why. Bounds the metrics' adapter label too."""
        engine = self.config.engine
        for name, folder in startup_adapters(Path(engine.model)):
            if not client.has_adapter(name):
                try:
                    client.add_adapter(name, folder)
                except AdapterError as err:
                    raise ValueError(f"invalid adapter {name}={folder}: {err}") from err
        self.metrics.adapter_labels = ((engine.max_cpu_loras or engine.max_loras)
                                       + len(client.adapters()))

    def _become_ready(self) -> None:
        if self._before_ready is not None:
            self._before_ready(self)
        self.status = "ready"

    def _watch_engine(self) -> None:
        """An engine that dies while serving (its core process killed, a tensor-parallel rank
        lost) cannot come back: stop the server so that the platform replaces it."""
        assert self.client is not None and self._on_engine_death is not None  # serve() set both
        while self.status == "ready":
            if not self.client.gauges().alive and self.status == "ready":
                logger.error("the engine stopped while serving; the server exits so that it is "
                             "restarted (SageMaker replaces the instance)")
                time.sleep(ENGINE_DEATH_GRACE_SECONDS)
                if self.status == "ready":  # not a shutdown that began meanwhile
                    self._on_engine_death()
                return
            time.sleep(ENGINE_WATCH_SECONDS)

    def shutdown(self, grace_seconds: float) -> None:
        """/ping and new requests answer 503 from now on; requests in flight get grace_seconds
        to finish, then end with a 503 error (a stream: its last line). The same for a custom
        handler's calls, queued or running (handler/lmi/runner.py)."""
        self.status = "stopping"
        if self.runner is not None:
            self.runner.shutdown(grace_seconds)
        if self.client is not None:
            self.client.shutdown(grace_seconds)

    def _connect(self) -> None:
        """Serve through the shared core process once it has loaded the model."""
        started = time.monotonic()
        address = self._core_address
        assert address is not None  # _load connects only to a shared core
        client = EngineClient.connect(self.config.engine, address.path, address.authkey,
                                      self.config.job_queue_size, self.metrics.on_step)
        try:  # model.py's formatters; a handler in it is refused
            self.formatters = load_custom_code(self.config, allow_handler=False).formatters
        except BaseException:
            client.shutdown(grace_seconds=0)  # says goodbye to the core
            raise
        self.serve(client)
        self._started_marker().touch()
        logger.info("connected to the engine core in %.1f s; serving",
                    time.monotonic() - started)

    def _started_marker(self) -> Path:
        assert self._core_address is not None  # only a process sharing a core marks it
        return Path(self._core_address.path).parent / f"started-{os.getpid()}"

    def _all_workers_started(self) -> bool:
        """With several HTTP processes, none says ready before all have started once: until
        then a request that the kernel hands to one still loading would get a 503."""
        if self._core_address is None or self._all_started:
            return True
        started = len(list(self._started_marker().parent.glob("started-*")))
        self._all_started = started >= self.config.api_server_count
        return self._all_started

    def _load(self) -> None:
        started = time.monotonic()
        try:
            time.sleep(self._load_delay)
            if self._prepare_model is not None:
                self._prepare_model()
            if self._core_address is not None:
                self._connect()
                return
            custom = load_custom_code(self.config)
            self.formatters = custom.formatters
            if custom.runner is not None:
                self.runner = custom.runner
                self.runner.start()
                self._become_ready()
                logger.info("handler ready in %.1f s; serving", time.monotonic() - started)
                return
            self.serve(EngineClient.from_config(self.config.engine, self.config.job_queue_size,
                                                self.metrics.on_step,
                                                process=self.config.engine_process))
            logger.info("model loaded in %.1f s; serving", time.monotonic() - started)
        except Exception as err:
            if is_config_error(err):  # "invalid <key>=<value>: ...": its line says it all
                logger.error("model loading failed: %s", err)
            else:
                logger.exception("model loading failed")
            self.status = "failed"
            if self._on_load_failure is not None:
                self._on_load_failure()
