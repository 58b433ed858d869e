"""Native model implementations: registry.py (architectures served natively), llama.py (the
Llama family), layers.py (RMSNorm, RoPE), linear.py (packed CPU matmuls), cpu_fused.py (fused
CPU ops), loader.py (config.json + safetensors → model), spec.py (ModelSpec)."""
