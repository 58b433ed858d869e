"""batchyard's engine. This module is its public face: the handler imports from here only.

A caller builds an EngineConfig, starts an EngineClient, turns text into token ids with it,
submits GenerationRequests and reads TokenEvents from the RequestHandles it gets back; gauges()
is what /ping and /metrics report. LLMEngine is the same engine without the thread, for
offline use. No flask and no env reads in engine/; importing this module does not import torch.
"""

from engine.config import (
    ATTENTION_BACKENDS,
    BATCHING_STRATEGIES,
    CUDAGRAPH_MODES,
    DEVICES,
    DTYPES,
    KV_BUFFER_DEVICES,
    KV_CONNECTORS,
    LINEAR_BACKENDS,
    MAX_LORA_RANKS,
    MODEL_IMPLS,
    QUANTIZATIONS,
    QUANTIZE_ALIASES,
    Disaggregation,
    EngineConfig,
    is_config_error,
)
from engine.core.server import CoreAddress, CoreServer
from engine.guided import GuidedSpec, check_spec
from engine.heap import freeze_start_up_heap
from engine.inputs import GenerationRequest
from engine.llm_engine import LLMEngine
from engine.lora.errors import AdapterError, AdapterNotFound, UnknownAdapter
from engine.model_files import ModelFileError, read_json_object
from engine.models.registry import NATIVE_ARCHITECTURES, PICKLE_SUFFIXES
from engine.outputs import Gauges, StepStats, TokenEvent
from engine.sampling_params import MAX_TOP_LOGPROBS, RequestError, SamplingParams
from engine.sequence import FinishReason
from engine.serving.client import EngineClient
from engine.serving.loop import CANCEL_CHECK_SECONDS, EngineDeadError, QueueFullError, RequestHandle

__all__ = [
    "ATTENTION_BACKENDS", "BATCHING_STRATEGIES", "CANCEL_CHECK_SECONDS", "CUDAGRAPH_MODES",
    "DEVICES", "DTYPES", "KV_BUFFER_DEVICES", "KV_CONNECTORS",
    "LINEAR_BACKENDS", "MAX_LORA_RANKS",
    "MAX_TOP_LOGPROBS", "MODEL_IMPLS", "NATIVE_ARCHITECTURES", "PICKLE_SUFFIXES", "QUANTIZATIONS",
    "QUANTIZE_ALIASES",
    "AdapterError", "AdapterNotFound", "CoreAddress", "CoreServer", "Disaggregation",
    "EngineClient",
    "EngineConfig", "EngineDeadError", "FinishReason", "Gauges",
    "GenerationRequest", "GuidedSpec", "LLMEngine", "ModelFileError", "QueueFullError",
    "RequestError", "RequestHandle", "SamplingParams", "StepStats", "TokenEvent",
    "UnknownAdapter", "check_spec",
    "freeze_start_up_heap", "is_config_error", "read_json_object", "serve_remote_worker",
]


def serve_remote_worker(router: tuple[str, int], key: bytes, model_dir: str | None,
                        gpu: int = 0) -> None:
    """Serve as a disaggregated worker of the router at `router` (another host's `batchyard
    serve`), proving `key`, on GPU number `gpu` (CUDA); returns when the router goes
    (engine/disagg/worker.py)."""
    from engine.disagg.worker import serve_remote  # torch: only a worker's process needs it

    serve_remote(router, key, model_dir, gpu)
