"""Run one competing engine ("peer") on a workload file and record every request's times.

A standalone script: it runs inside the peer's own virtualenv (vLLM pins its own transformers),
so it imports only the standard library, torch, transformers and vllm, never batchyard.

    python peer_worker.py --peer hf-static --model-dir DIR --workload W.json --concurrency C \
        --out R.json [--dtype float32|bfloat16] [--threads T] [--device cpu|cuda]

W.json is {"requests": [{"prompt_ids": [...], "new_tokens": n}, ...]}. The requests run in a
closed loop at concurrency C in the given order (a new one starts as soon as one finishes),
greedy, EOS ignored but not banned (as batchyard's ignore_eos), after a warm-up that is not
timed. Times are time.perf_counter() seconds of this process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("peer_worker")

PEERS = ("hf-static", "hf-cb", "vllm", "vllm-all")
FIRST_TOKENS = 16
WARMUP_TOKENS = 2
HF_PAGE_SIZE = 256


def record(start: float, end: float, token_times: list[float], num_tokens: int, expected: int,
           error: str = "") -> dict:
    """One request's result; it is ok only with exactly the requested number of tokens."""
    if not error and num_tokens != expected:
        error = f"generated {num_tokens} tokens, asked for {expected}"
    return {"start": start, "end": end, "token_times": token_times,
            "num_output_tokens": num_tokens, "ok": not error, "error": error[:300]}


def hf_model(model_dir: Path, dtype: str, threads: int, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    logger.info("torch threads: %d (default: all cores, as batchyard's server uses)", threads)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa").to(device).eval()
    # generate() fills an unset eos_token_id from here; None = never stop, as ignore_eos does
    model.generation_config.eos_token_id = None
    return model


def hf_versions() -> dict[str, str]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def run_static_batch(model, batch: list[dict], pad_id: int) -> tuple[list[dict], list[list[int]]]:
    """One left-padded `generate` call that runs to the batch's longest request; each request
    sees the step times of its first n tokens and ends when the call returns."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """put() gets the prompt once, then each step's new tokens: time the steps."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value) -> None:
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    width = max(len(r["prompt_ids"]) for r in batch)
    ids = torch.tensor([[pad_id] * (width - len(r["prompt_ids"])) + r["prompt_ids"]
                        for r in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"])
                         for r in batch], device=model.device)
    longest = max(r["new_tokens"] for r in batch)
    config = GenerationConfig(do_sample=False, max_new_tokens=longest, min_new_tokens=0,
                              eos_token_id=None, pad_token_id=pad_id)
    clock = Clock()
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config,
                                 streamer=clock)
    except Exception as err:  # a failed batch is a row of errors, the run goes on
        end = time.perf_counter()
        return [record(start, end, [], 0, r["new_tokens"], f"{type(err).__name__}: {err}")
                for r in batch], [[] for _ in batch]
    end = time.perf_counter()
    tokens = [out[i, width:width + r["new_tokens"]].tolist() for i, r in enumerate(batch)]
    return [record(start, end, clock.times[:r["new_tokens"]], len(t), r["new_tokens"])
            for r, t in zip(batch, tokens, strict=True)], tokens


def hf_static(args: argparse.Namespace, requests: list[dict]) -> dict:
    model = hf_model(args.model_dir, args.dtype, args.threads, args.device)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    run_static_batch(model, warmup_requests(requests, args.concurrency), pad_id)
    startup = time.perf_counter() - args.t0
    results, first = [], []
    for i in range(0, len(requests), args.concurrency):
        batch_results, tokens = run_static_batch(model, requests[i:i + args.concurrency], pad_id)
        results += batch_results
        first = tokens[0] if i == 0 else first
    return {"startup_s": startup, "requests": results, "first_tokens": first[:FIRST_TOKENS],
            "versions": hf_versions(), "threads": args.threads}


def hf_cb_manager(model, requests: list[dict], concurrency: int):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Sized to hold the C longest requests (+10 %): the CPU default is 90 % of all RAM,
    # zeroed at start; block sharing (prefix caching) off, like the other engines here.
    longest = max(len(r["prompt_ids"]) + r["new_tokens"] for r in requests)
    blocks = concurrency * (-(-longest // HF_PAGE_SIZE) + 1)
    cb_config = ContinuousBatchingConfig(page_size=HF_PAGE_SIZE, num_blocks=blocks * 11 // 10 + 1,
                                         max_requests_per_batch=concurrency,
                                         allow_block_sharing=False)
    config = GenerationConfig(do_sample=False, eos_token_id=-1,
                              max_new_tokens=max(r["new_tokens"] for r in requests))
    manager = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=cb_config)
    manager.start()
    return manager


def hf_cb_loop(manager, requests: list[dict], concurrency: int) -> tuple[list[dict], list[int]]:
    """Closed loop: C requests in flight, the next added as soon as a finished one comes back."""
    pending = deque(enumerate(requests))
    starts: dict[str, tuple[int, float]] = {}
    results: list[dict | None] = [None] * len(requests)
    first: list[int] = []

    def submit() -> None:
        i, r = pending.popleft()
        starts[f"r{i}"] = (i, time.perf_counter())
        manager.add_request(r["prompt_ids"], request_id=f"r{i}", max_new_tokens=r["new_tokens"],
                            eos_token_id=-1, record_timestamps=True)

    while pending and len(starts) < concurrency:
        submit()
    while starts:
        out = manager.get_result(timeout=1.0)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
            continue
        if not out.is_finished():
            continue
        end = time.perf_counter()
        i, start = starts.pop(out.request_id)
        tokens = list(out.generated_tokens)
        results[i] = record(start, end, list(out.timestamps or []), len(tokens),
                            requests[i]["new_tokens"], out.error or "")
        first = tokens if i == 0 else first
        if pending:
            submit()
    return [r for r in results if r is not None], first


def hf_cb(args: argparse.Namespace, requests: list[dict]) -> dict:
    model = hf_model(args.model_dir, args.dtype, args.threads, args.device)
    manager = hf_cb_manager(model, requests, args.concurrency)
    try:
        hf_cb_loop(manager, warmup_requests(requests, args.concurrency), args.concurrency)
        startup = time.perf_counter() - args.t0
        results, first = hf_cb_loop(manager, requests, args.concurrency)
    finally:
        manager.stop(block=True, timeout=60)
    return {"startup_s": startup, "requests": results, "first_tokens": first[:FIRST_TOKENS],
            "versions": hf_versions(), "threads": args.threads}


def warmup_requests(requests: list[dict], concurrency: int) -> list[dict]:
    """The first C prompts with a few tokens each: exercises batched prefill and decode."""
    return [{**r, "new_tokens": WARMUP_TOKENS} for r in requests[:concurrency]]


def vllm_env(peer: str) -> None:
    """Set before vllm is imported: its engine and worker processes read these at start."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; its default asks 92 % of RAM
    if peer == "vllm-all":  # all cores compute; out of the box one is kept for the scheduler
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"


def closed_loop(requests: list[dict], concurrency: int, tag: str,
                add: Callable[[str, dict], None],
                step: Callable[[], list[tuple[str, list[int], bool, str]]]
                ) -> tuple[list[dict], list[int]]:
    """C requests in flight, the next added as soon as one finishes. `add(key, request)`
    submits one; `step()` runs the engine once and returns (key, new token ids, finished,
    error) per request it moved. A token's time is the return of the step that gave it."""
    pending = deque(enumerate(requests))
    live: dict[str, tuple[int, float, list[float], list[int]]] = {}
    results: list[dict | None] = [None] * len(requests)
    first: list[int] = []

    def submit() -> None:
        i, r = pending.popleft()
        live[f"{tag}{i}"] = (i, time.perf_counter(), [], [])
        add(f"{tag}{i}", r)

    while pending and len(live) < concurrency:
        submit()
    while live:
        updates = step()
        now = time.perf_counter()
        for key, new, finished, error in updates:
            i, start, times, tokens = live[key]
            times += [now] * len(new)
            tokens += new
            if finished:
                del live[key]
                results[i] = record(start, now, times, len(tokens), requests[i]["new_tokens"],
                                    error)
                first = tokens if i == 0 else first
                if pending:
                    submit()
    return [r for r in results if r is not None], first


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=PEERS, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads of the HF peers (default: all cores)")
    parser.add_argument("--kv-cache-bytes", type=int, help="vLLM's KV cache size")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the HF peers run (vLLM-CPU: always the CPU)")
    args = parser.parse_args(argv)
    args.t0 = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    requests = json.loads(args.workload.read_text())["requests"]
    logger.info("peer %s: %d requests at concurrency %d, %s", args.peer, len(requests),
                args.concurrency, args.dtype)
    run = {"hf-static": hf_static, "hf-cb": hf_cb}.get(args.peer, vllm_peer)
    result = {"peer": args.peer, "device": args.device if args.peer.startswith("hf") else "cpu",
              **run(args, requests)}
    args.out.write_text(json.dumps(result))
    errors = sum(not r["ok"] for r in result["requests"])
    logger.info("peer %s: done, %d errors, startup %.1f s", args.peer, errors, result["startup_s"])
    return 0


if __name__ == "__main__":  # required: vLLM spawns its engine and worker processes
    sys.exit(main())
