"""The KV pool's bookkeeping, pure Python: allocator.py (one contiguous region per sequence),
block_manager.py (paged blocks on demand, prefix cache), budget.py (how many blocks fit)."""
