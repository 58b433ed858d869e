"""Disaggregated prefill and decode (DistServe) with cooperative prefill (KV-Runahead): worker
processes, the KV hand-off between their pools, and the router the serving side talks to."""
