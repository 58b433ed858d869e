"""batchyard's engine: the public façade for the handler. No flask, no env reads here."""

from engine.config import BATCHING_STRATEGIES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.loop import EngineDeadError, EngineLoop, QueueFullError, RequestHandle
from engine.outputs import StepStats, TokenEvent
from engine.sampling_params import RequestError, SamplingParams
from engine.sequence import FinishReason

__all__ = [
    "BATCHING_STRATEGIES", "EngineConfig", "EngineDeadError", "EngineLoop", "FinishReason",
    "LLMEngine", "QueueFullError", "RequestError", "RequestHandle", "SamplingParams", "StepStats",
    "TokenEvent",
]
