import shutil, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, Phi3Config, Gemma3TextConfig, MixtralConfig
src = Path("/root/.cache/batchyard/models/SmolLM2-135M-Instruct")
base = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            bos_token_id=1, eos_token_id=2)
families = {
    "phi3": Phi3Config(**base),
    "gemma3": Gemma3TextConfig(**{**base, "head_dim": 64, "sliding_window": 64,
                                  "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "mixtral": MixtralConfig(**{**base, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
for name, config in families.items():
    out = Path(sys.argv[1]) / name
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    print(name, sum(p.numel() for p in model.parameters()) / 1e6, "M")
