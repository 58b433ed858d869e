"""ServerState: the model's life cycle (loading → ready | failed) shared by request threads."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from jinja2 import TemplateError

from engine import EngineLoop, LLMEngine, RequestError, SamplingParams
from handler.metrics import Metrics
from handler.serving_config import ServingConfig

logger = logging.getLogger(__name__)


class ServerState:
    """Loads the engine in the background; answers readiness without ever blocking on it."""

    def __init__(self, config: ServingConfig, prepare_model: Callable[[], Path] | None = None,
                 on_load_failure: Callable[[], None] | None = None,
                 load_delay: float = 0.0) -> None:
        self.config = config
        self.metrics = Metrics()
        self.model_name = Path(config.engine.model).name
        self.status = "loading"
        self.loop: EngineLoop | None = None
        self.engine: LLMEngine | None = None
        self._prepare_model = prepare_model
        self._on_load_failure = on_load_failure
        self._load_delay = load_delay  # test hook: makes the loading phase observable
        self._tokenizer_lock = threading.Lock()

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="model-loader", daemon=True).start()

    def ready(self) -> bool:
        return self.status == "ready" and self.loop is not None and self.loop.is_alive()

    def encode(self, text: str) -> list[int]:
        assert self.engine is not None
        with self._tokenizer_lock:  # NOTE: HF tokenizers are not safe to share across threads
            return self.engine.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        assert self.engine is not None
        tokenizer = self.engine.tokenizer
        with self._tokenizer_lock:
            if not tokenizer.chat_template:
                raise RequestError("this model has no chat template; send {\"inputs\": ...}",
                                   "messages")
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=False)
            except TemplateError as err:  # e.g. the template wants alternating roles
                raise RequestError(f"messages do not fit the model's chat template: {err}",
                                   "messages") from err
            return tokenizer.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text (for logprob alternatives)."""
        assert self.engine is not None
        with self._tokenizer_lock:
            return self.engine.tokenizer.decode([token_id])

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        assert self.engine is not None
        self.engine.validate(prompt_ids, params)

    def shutdown(self, grace_seconds: float) -> None:
        self.status = "stopping"
        if self.loop is not None:
            self.loop.shutdown(grace_seconds)

    def _load(self) -> None:
        started = time.monotonic()
        try:
            time.sleep(self._load_delay)
            if self._prepare_model is not None:
                self._prepare_model()
            self.engine = LLMEngine.from_config(self.config.engine)
            self.loop = EngineLoop(self.engine, self.config.job_queue_size, self.metrics.on_step)
            self._watch_engine(self.engine)
            self.loop.start()
            self.status = "ready"
            logger.info("model loaded in %.1f s; serving", time.monotonic() - started)
        except Exception:
            logger.exception("model loading failed")
            self.status = "failed"
            if self._on_load_failure is not None:
                self._on_load_failure()

    def _watch_engine(self, engine: LLMEngine) -> None:
        scheduler = engine.scheduler
        allocator = scheduler.allocator

        def hit_rate() -> float:
            queries = getattr(allocator, "prefix_queries", 0)
            return getattr(allocator, "prefix_hits", 0) / queries if queries else 0.0

        self.metrics.watch(lambda: len(scheduler.waiting), lambda: len(scheduler.running),
                           lambda: allocator.num_used_blocks, lambda: allocator.num_blocks,
                           hit_rate)
        self.metrics.max_concurrency.set(engine.max_concurrency)
        self.metrics.kv_block_size.set(allocator.block_size)
