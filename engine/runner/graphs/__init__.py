"""Steps at fixed shapes over static buffers, what CUDA graphs replay: whole_step.py (padded
whole-step graphs), piecewise.py (graphs cut at every attention call, for wider steps),
setup.py (build and capture them at start-up, hand them to the runner, or run eagerly), check.py
(their logits against the eager step's)."""
