"""EngineClient: the engine's one boundary for callers on other threads (the HTTP edge).

Text goes in and comes out here (encode, encode_chat, decode); requests are typed and validated
once, here, before they reach the loop's inbox; gauges() is the state /ping and /metrics read;
LoRA adapters are registered and removed through it (the core applies them between steps).
Nothing behind it (tokenizer, scheduler, allocator) is for callers to touch."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from jinja2 import TemplateError

from engine.config import EngineConfig
from engine.core.adapters import AdapterList
from engine.core.engine_core import ThreadCore
from engine.guided import GuidedDecoding
from engine.inputs import AddAdapter, GenerationRequest, RemoveAdapter, RequestLimits
from engine.llm_engine import LLMEngine
from engine.lora.errors import UnknownAdapter
from engine.outputs import Gauges, StepStats
from engine.sampling_params import RequestError
from engine.serving.loop import Core, EngineDeadError, EngineLoop, RequestHandle
from engine.text.tokenizer_files import load_tokenizer
from engine.text.tokenizer_pool import MAX_CHARS_PER_TOKEN, TokenizerPool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.core.process import ProcessCore
    from engine.disagg.router import DisaggregatedCore


class EngineClient:
    """The serving side of one engine: tokenizer, validation, the loop; the core behind it
    runs on a thread of this process or in its own (from_config(..., process=True))."""

    def __init__(self, engine: LLMEngine, max_queued: int,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        """Serve `engine` (already loaded here) from a core thread."""
        core = ThreadCore(engine)
        self._init(core, engine.tokenizer, engine.limits, engine.config, max_queued, on_step,
                   engine.guided, adapters=core.initial_adapters,
                   lora_enabled=engine.config.enable_lora)

    @classmethod
    def from_config(cls, config: EngineConfig, max_queued: int,
                    on_step: Callable[[StepStats], None] | None = None,
                    process: bool = False) -> EngineClient:
        """Load the model and build the engine, here or in a core process; start() then begins
        serving."""
        if config.disaggregation is not None:  # worker processes behind a router
            from engine.disagg.router import DisaggregatedCore

            core: ProcessCore | DisaggregatedCore = DisaggregatedCore(config)
        elif not process:
            return cls(LLMEngine.from_config(config), max_queued, on_step)
        else:
            from engine.core.process import ProcessCore

            core = ProcessCore(config)  # loads the model while this process loads the tokenizer
        try:
            tokenizer = load_tokenizer(config)
            core.wait_ready()
        except BaseException:
            core.terminate()
            raise
        client = cls.__new__(cls)
        if config.disaggregation is not None:  # every decode worker runs max_num_seqs
            config = replace(config, max_num_seqs=config.max_num_seqs
                             * config.disaggregation.num_decode_workers)
        # A Core once ready: receive() then yields CoreUpdates only (CoreReady came first).
        client._init(cast(Core, core), tokenizer, core.limits, config, max_queued, on_step,
                     adapters=core.initial_adapters, lora_enabled=core.lora_enabled)
        return client

    @classmethod
    def connect(cls, config: EngineConfig, path: str, authkey: bytes, max_queued: int,
                on_step: Callable[[StepStats], None] | None = None) -> EngineClient:
        """Serve through a core process that other processes share (engine/core/server.py):
        wait until it has loaded the model, then load the tokenizer."""
        from engine.core.process import RemoteCore

        core = RemoteCore(path, authkey)
        try:
            core.wait_ready()
            tokenizer = load_tokenizer(config)
        except BaseException:
            core.terminate()
            raise
        client = cls.__new__(cls)
        # A Core once ready: receive() then yields CoreUpdates only (CoreReady came first).
        client._init(cast(Core, core), tokenizer, core.limits, config, max_queued, on_step,
                     id_prefix=f"req-{secrets.token_hex(4)}-",  # unique in the shared core
                     adapters=core.initial_adapters, lora_enabled=core.lora_enabled)
        return client

    def _init(self, core: Core, tokenizer: PreTrainedTokenizerBase, limits: RequestLimits,
              config: EngineConfig, max_queued: int, on_step: Callable[[StepStats], None] | None,
              guided: GuidedDecoding | None = None, id_prefix: str = "req-",
              adapters: AdapterList = (), lora_enabled: bool = False) -> None:
        # The loop's output thread detokenizes with `tokenizer`; callers borrow copies.
        self._tokenizers = TokenizerPool(tokenizer)
        template = tokenizer.chat_template
        self._template_takes_tools = isinstance(template, str) and "tools" in template
        # Grammars are checked here, with the tokenizer, so that a bad one is the client's 400:
        # with the engine's own llguidance tokenizer view when it runs in this process (built
        # once), else with one of this process's.
        if guided is None:
            guided = GuidedDecoding(tokenizer, limits.vocab_size, frozenset())
            guided.build_in_background()
        self._guided = guided
        self._limits = limits
        self.max_prompt_chars = limits.max_model_len * MAX_CHARS_PER_TOKEN
        self._loop = EngineLoop(core, tokenizer, config.max_num_seqs, max_queued, on_step,
                                id_prefix, adapters)
        self._lora_enabled = lora_enabled

    def start(self) -> None:
        self._guided.wait_built()  # its build would stall the first requests' steps
        self._loop.start()

    def shutdown(self, grace_seconds: float) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, abort the rest."""
        self._loop.shutdown(grace_seconds)

    # --- text ---

    def encode(self, text: str, *, truncate: int | None = None) -> list[int]:
        """Token ids of a prompt; one too long to ever fit is refused before tokenizing. With
        `truncate` (TGI's), its last `truncate` tokens, any length, from tokenizing only as
        much of its tail as they need (one client's 5 MiB prompt is not seconds of tokenizing
        that others wait behind)."""
        if truncate is None:
            self._check_chars(len(text), "inputs")
            return self._tokenizers.encode(text)
        limit = self._limits.max_model_len
        ids = self._tokenizers.encode_tail(text, min(truncate, limit + 1))
        if len(ids) > limit:  # only when truncate > max_model_len: it could never run
            raise RequestError(
                f"inputs has more than {limit} tokens after truncate={truncate}; at most "
                f"max_model_len={limit} fit", "inputs")
        return ids

    @property
    def template_takes_tools(self) -> bool:
        """The chat template renders `tools` itself (else the caller describes them)."""
        return self._template_takes_tools

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The model's chat template applied (with `tools` when given), ready to generate the
        assistant's turn."""
        self._check_chars(sum(len(str(m.get("content", ""))) for m in messages), "messages")
        with self._tokenizers.borrow() as tokenizer:
            if not tokenizer.chat_template:
                raise RequestError("this model has no chat template; send {\"inputs\": ...}",
                                   "messages")
            try:
                text = tokenizer.apply_chat_template(messages, tools=tools,
                                                     add_generation_prompt=True, tokenize=False)
            except TemplateError as err:  # e.g. the template wants alternating roles
                raise RequestError(f"messages do not fit the model's chat template: {err}",
                                   "messages") from err
        return self._tokenizers.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, e.g. one logprob alternative's."""
        with self._tokenizers.borrow() as tokenizer:
            text: str = tokenizer.decode(list(token_ids))
        return text

    def _check_chars(self, chars: int, field: str) -> None:
        if chars > self.max_prompt_chars:
            raise RequestError(
                f"{field} has {chars} characters; at most {self.max_prompt_chars} "
                f"(max_model_len {self._limits.max_model_len} x {MAX_CHARS_PER_TOKEN}) are "
                "tokenized: more could never fit in max_model_len tokens", field)

    def check_room(self, count: int) -> None:
        """Raise QueueFullError if `count` more requests would not be admitted now: a cheap
        refusal before any tokenizing (submit checks again, atomically)."""
        self._loop.check_room(count)

    # --- requests ---

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Validate and queue one request; raises RequestError, QueueFullError or
        EngineDeadError, and queues nothing when it raises."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Validate every request, then queue them all or none."""
        for request in requests:
            self._limits.validate(request.prompt_token_ids, request.params)
            if request.params.guided is not None:
                self._guided.check(request.params.guided)
            adapter = request.params.adapter
            if adapter is not None and not self._loop.adapters.has(adapter):
                raise UnknownAdapter(adapter, self._loop.adapters.names())
        return self._loop.submit(requests)

    def abort(self, request_id: str) -> None:
        """End a request and free its KV (no-op when it already finished)."""
        self._loop.abort(request_id)

    def gauges(self) -> Gauges:
        return self._loop.gauges()

    def is_alive(self) -> bool:
        """gauges().alive without the snapshot: asked on every request."""
        return self._loop.is_alive()

    # --- LoRA adapters ---

    @property
    def lora_enabled(self) -> bool:
        """Whether adapters can be registered (option.enable_lora)."""
        return self._lora_enabled

    def add_adapter(self, name: str, path: str) -> None:
        """Register the PEFT folder `path` (on the core's host) as adapter `name`; returns once
        a request naming it is accepted. Raises AdapterError (the reason it is refused),
        RuntimeError (LoRA is not enabled) or EngineDeadError (the core stopped)."""
        self._call_core(lambda call_id: AddAdapter(call_id, name, path))

    def remove_adapter(self, name: str) -> None:
        """New requests may no longer name it; those already using it finish with it. Raises
        AdapterNotFound, RuntimeError (LoRA is not enabled) or EngineDeadError."""
        self._call_core(lambda call_id: RemoveAdapter(call_id, name))

    def adapters(self) -> list[tuple[str, str]]:
        """(name, folder) of every registered adapter, sorted by name (every front's, when
        several serve one core: as of the core's latest update)."""
        return self._loop.adapters.listed()

    def has_adapter(self, name: str) -> bool:
        return self._loop.adapters.has(name)

    def _call_core(self, make: Callable[[str], AddAdapter | RemoveAdapter]) -> None:
        reply = self._loop.adapters.call(make)
        if reply is None:
            raise EngineDeadError("the engine is not running; the adapter call was not answered")
        reply.raise_error()
