"""Random-weight Llama models of a chosen size (and a Gemma 3-shaped one), for benchmarks on a
big model with no model hub.

The weights are noise, so the text is too: run such a model with EOS ignored (the LMI workload
does). Only the shapes matter for speed, and they are those of the named Llama.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger(__name__)

# Llama-3.2-1B's shapes (the vocabulary comes from the tokenizer: 49,152 for the default
# model's gives 1.07 B parameters); tiny is for tests.
PRESETS: dict[str, dict] = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
                 "max_position_embeddings": 8192, "tie_word_embeddings": True},
    # Llama-2-7B's shapes (6.7 B parameters with its 32,000-token vocabulary; with the default
    # model's 49,152 tokens, 6.9 B): the size the LMI study served.
    "llama-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32,
                 "max_position_embeddings": 4096, "tie_word_embeddings": False},
    "llama-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2,
                   "max_position_embeddings": 2048, "tie_word_embeddings": False},
    # Gemma 3's layer pattern (five 32-token-window layers, then a full one) at a small width:
    # what KV groups (engine/kv/layout.py) save, on a CPU
    "gemma3-small": {"model_type": "gemma3_text", "hidden_size": 256,
                     "intermediate_size": 512, "num_hidden_layers": 12,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                     "sliding_window": 32, "max_position_embeddings": 2048,
                     "tie_word_embeddings": False},
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_random_llama(out: Path, tokenizer_dir: Path, preset: str = "llama-1b",
                       dtype: str = "bfloat16", device: str = "cpu", seed: int = 0) -> int:
    """Writes config, safetensors weights and `tokenizer_dir`'s tokenizer to `out`, which must
    be new or empty; returns the number of parameters."""
    if preset not in PRESETS:
        raise ValueError(f"preset: {preset!r} is not one of {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"out: {out} is not empty; choose a new folder")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shapes = dict(PRESETS[preset])
    config = AutoConfig.for_model(shapes.pop("model_type", "llama"), vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **shapes)
    torch.manual_seed(seed)
    # Initialised where it will run and in its dtype: a 1B model in float32 takes minutes on a
    # small CPU, and a 7B one in float32 would need 27 GB.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).eval()
    num_params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    logger.info("%s: %s with %.3f B parameters in %s", out, preset, num_params / 1e9, dtype)
    return num_params
