"""The engine core and where it runs: engine_core.py (EngineCore: inbox, deadlines, steps),
process.py (the core in a process of its own, behind pipes), server.py and fronts.py (one core
behind several serving processes), tp_worker.py (the entry of a tensor-parallel worker rank),
adapters.py (LoRA adapter calls answered by the core)."""
