"""The model runner and what one step is made of: model_runner.py (the only place that builds
device tensors), step_plan.py / step_buffer.py / step_pages.py / step_metadata.py (a step
planned in integers, packed, uploaded, turned into attention metadata), sampler.py,
attention_check.py (the attention backend's start-up check), tp_workers.py (rank 0's handle on
tensor-parallel workers), setup.py (what every rank builds at start-up), graphs/ (CUDA graphs)."""
