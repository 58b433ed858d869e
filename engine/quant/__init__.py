"""Pre-quantized checkpoints (AWQ, GPTQ, FP8, compressed-tensors) and option.quantize=fp8:
scheme.py reads config.json's quantization_config, unpack.py decodes each format's tensors
into one layout, load.py places them (tensor-parallel parts included) in the native model,
linear.py computes with them at their quantized size."""
