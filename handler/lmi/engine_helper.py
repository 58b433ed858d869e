"""batchyard's engine for a custom handler that adds its own pre/post-processing:

    from handler.lmi.engine_helper import load_engine

    engine = None

    def handle(inputs):
        global engine
        if engine is None:
            engine = load_engine(inputs.get_properties())  # the start-up call's properties
        ...
        result = engine.generate(prompt, {"max_new_tokens": 64})  # {"generated_text": ...}

The engine keeps its own scheduler (the strategy serving.properties selects), so requests from
concurrent handler calls (maxWorkers > 1) are batched together."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from engine import EngineClient, GenerationRequest, read_json_object
from handler.config.properties import Setting, canonical_key
from handler.config.serving_config import ServingConfig, build_serving_config
from handler.http.schemas import HTTPError, details_dict, sampling_params, token_dict

# Start-up properties that describe the process, not the engine.
_PROCESS_KEYS = {"model_dir", "device_id", "tensor_parallel_degree", "entryPoint", "handler",
                 "input_formatter", "output_formatter", "maxWorkers", "batch_size"}


class LocalEngine:
    """A started engine with LMI-shaped generate/stream calls (text in, dicts out)."""

    def __init__(self, client: EngineClient, config: ServingConfig) -> None:
        self.client = client
        self.config = config

    def generate(self, inputs: str, parameters: Mapping | None = None) -> dict:
        """{"generated_text", "details"?}; raises ValueError for bad parameters (→ 424)."""
        params, details = self._params(parameters)
        events = [event for event, _ in self._submit(inputs, params).all_events()]
        last = events[-1]
        if last.error is not None or last.finish_reason in ("abort", "timeout", "error"):
            raise RuntimeError(f"generation ended with {last.finish_reason}: {last.error}")
        result: dict = {"generated_text": "".join(e.text for e in events)}
        if details:
            result["details"] = details_dict(events, with_tokens=True)
        return result

    def stream(self, inputs: str, parameters: Mapping | None = None) -> Iterator[dict]:
        """LMI jsonlines objects: {"token"} per token, the last with generated_text."""
        params, _ = self._params(parameters)
        handle = self._submit(inputs, params, stream=True)
        text = []
        try:
            for event in handle.events():
                line: dict = {"token": token_dict(event)} if event.token_id is not None else {}
                text.append(event.text)
                if event.finished:
                    line["generated_text"] = "".join(text)
                yield line
        finally:
            handle.abort()

    def shutdown(self, grace_seconds: float = 5.0) -> None:
        self.client.shutdown(grace_seconds)

    def _params(self, parameters: Mapping | None):
        parameters = dict(parameters or {})
        details = bool(parameters.pop("details", False))
        try:
            return sampling_params(parameters), details
        except HTTPError as err:
            raise ValueError(err.message) from err

    def _submit(self, inputs: str, params, stream: bool = False):
        deadline = None if stream else time.monotonic() + self.config.predict_timeout
        request = GenerationRequest(tuple(self.client.encode(inputs)), params, deadline)
        return self.client.submit(request)


def load_engine(properties: Mapping[str, str]) -> LocalEngine:
    """Build and start the engine from the handler's start-up properties (option. stripped,
    model_dir added), exactly as serving.properties would without the custom handler."""
    model_dir = Path(properties["model_dir"])
    settings = {canonical_key(key if key in ("job_queue_size", "max_batch_delay")
                              else f"option.{key}"): Setting(str(value), "handler properties")
                for key, value in properties.items() if key not in _PROCESS_KEYS}
    architectures = read_json_object(model_dir / "config.json").get("architectures", [])
    config = build_serving_config(settings, model_dir, architectures)
    client = EngineClient.from_config(config.engine, config.job_queue_size)
    client.start()
    return LocalEngine(client, config)
