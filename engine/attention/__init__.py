"""Attention over the paged KV pool: reference.py (gather + SDPA, the truth in tests), flex.py
(FlexAttention, GPU), cpu.py (C decode loops reading the pool in place), check.py (start-up
check against the reference, and fallback), select.py (which backend runs)."""
