"""Random Phi-3, Gemma 3 and Mixtral folders for `bench model-impl`, with the embedded default
model's tokenizer (run once `batchyard serve` has unpacked it):

    python -m benchmark.tools.build_families OUT

4 layers, hidden 256, 4 heads / 2 KV heads, float32, seed 0: the models of the native-families
run (docs/benchmark/cpu-2026-11-25-native-families/).
"""

import argparse
import logging
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, MixtralConfig, Phi3Config

TOKENIZER = Path.home() / ".cache/batchyard/models/SmolLM2-135M-Instruct"
BASE = {"vocab_size": 49152, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2}
FAMILIES = {
    "phi3": Phi3Config(**BASE),
    "gemma3": Gemma3TextConfig(**BASE, head_dim=64, sliding_window=64,
                               layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "mixtral": MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2),
}


def main(out: Path) -> None:
    for name, config in FAMILIES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(out / name)
        for file in TOKENIZER.glob("tokenizer*"):
            shutil.copy(file, out / name / file.name)
        logging.info("%s: %.1f M parameters", name,
                     sum(p.numel() for p in model.parameters()) / 1e6)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.build_families",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for phi3/, gemma3/ and mixtral/")
    out = parser.parse_args().out
    logging.basicConfig(level=logging.INFO)
    main(out)
