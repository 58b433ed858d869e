"""Tensor-parallel primitives below the model: shard.py (which slice of the model a rank
holds), comm.py (the collectives). Rank 0's handle on the workers is engine/runner/tp_workers.py,
a worker rank's entry engine/core/tp_worker.py."""
