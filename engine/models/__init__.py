"""Native model implementations, keyed by the HF `architectures` name in config.json."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
