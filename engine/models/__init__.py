"""Native model implementations: registry.py (one record per architecture served natively: the
features its implementation reads), llama.py (the Llama family), gemma.py (the Gemma family),
windows.py (which layers slide, per record), moe.py (sparse experts), layers.py (RMSNorm, RoPE),
linear.py (packed CPU matmuls), cpu_fused.py (fused CPU ops), placement.py (checkpoint tensor →
parameter), loader.py (config.json + safetensors → model), spec.py (ModelSpec)."""
