"""Attention over the paged KV pool: reference.py (gather + SDPA, the truth in tests), flex.py
(FlexAttention, GPU), cpu.py (C decode loops reading the pool in place), select.py (which
backend runs). The start-up check against the reference is engine/runner/attention_check.py."""
