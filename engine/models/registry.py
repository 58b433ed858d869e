"""Which architectures run natively, and which checkpoint files are never loaded. Pure Python:
the handler chooses a strategy from it before torch is imported."""

from __future__ import annotations

# The HF `architectures` name in config.json -> the family that implements it (see loader.py).
NATIVE_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
}

# Unpickling a checkpoint can run arbitrary code: only safetensors are loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
