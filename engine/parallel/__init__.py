"""Tensor parallelism: shard.py (which slice of the model a rank holds), comm.py (the
collectives), workers.py (rank 0's handle on the worker ranks), worker.py (a worker rank)."""
