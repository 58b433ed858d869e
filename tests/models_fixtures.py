"""Tiny random-weight models and a locally trained tokenizer, built offline for tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB_SIZE = 320
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1 (bos), 2 (eos)
CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Once upon a time there was a little turtle who lived by the sea.",
    "Write a program to add two numbers in python: print(1 + 2)",
    "Grüße aus Köln! Café, naïve, 東京, 🙂 and other multi-byte text.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

ARCH_CONFIGS = {
    "llama": (LlamaConfig, {"num_key_value_heads": 2}),
    "llama_tied_llama3": (LlamaConfig, {
        "num_key_value_heads": 1, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama_linear": (LlamaConfig, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": (MistralConfig, {"num_key_value_heads": 2, "sliding_window": 12}),
    "qwen2": (Qwen2Config, {"num_key_value_heads": 2}),
    "qwen3": (Qwen3Config, {"num_key_value_heads": 2, "head_dim": 16}),
    "phi3": (Phi3Config, {"num_key_value_heads": 2}),
    # Phi-4-mini's shape (tied; part of each head rotated), LongRoPE past 34 tokens
    "phi3_longrope": (Phi3Config, {
        "num_key_value_heads": 1, "tie_word_embeddings": True,
        "original_max_position_embeddings": 34,
        "rope_parameters": {"rope_type": "longrope", "partial_rotary_factor": 0.5,
                            "short_factor": [1.0, 1.3, 1.9, 2.6],
                            "long_factor": [2.0, 3.5, 5.0, 9.0],
                            "original_max_position_embeddings": 34}}),
    # sparse experts: top-2 of 4 (Mixtral renormalises them; this Qwen3-MoE does not)
    "mixtral": (MixtralConfig, {"num_key_value_heads": 2, "num_local_experts": 4,
                                "num_experts_per_tok": 2}),
    # Qwen2-MoE: q/k/v biases and a shared expert behind a sigmoid gate, top-k renormalised
    "qwen2_moe": (Qwen2MoeConfig, {"num_key_value_heads": 2, "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "shared_expert_intermediate_size": 48,
                                   "norm_topk_prob": True}),
    "qwen3_moe": (Qwen3MoeConfig, {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    # not native: served through the transformers fallback (engine/models/hf_fallback.py)
    "gpt_neox": (GPTNeoXConfig, {}),
    "opt": (OPTConfig, {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    # Gemma: untied, because a random model with tied embeddings scaled by sqrt(hidden) repeats
    # one token whatever it attends to, which would prove nothing about windows or norms
    "gemma": (GemmaConfig, {"num_key_value_heads": 1, "head_dim": 16,
                            "tie_word_embeddings": False}),
    "gpt2": (GPT2Config, {}),
    # logit soft-capping on every layer, a sliding window on every other one
    "gemma2": (Gemma2Config, {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 6,
                              "tie_word_embeddings": False}),
    # a sliding layer (its own RoPE base) and a full one, no soft-capping
    "gemma3": (Gemma3TextConfig, {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 6,
                                  "layer_types": ["sliding_attention", "full_attention"],
                                  "tie_word_embeddings": False}),
}


def build_tokenizer(path: Path, corpus: list[str] = CORPUS) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences (multi-byte safe), saved to path."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A 2-layer random model of the given family plus tokenizer in `path`; returns path."""
    config_cls, arch_overrides = ARCH_CONFIGS[arch]
    tokenizer = build_tokenizer(path)
    settings = {"vocab_size": max(VOCAB_SIZE, len(tokenizer)), "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
                "pad_token_id": 2}
    config = config_cls(**{**settings, **arch_overrides, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than the 0.02 default init, so logits are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path
