"""The transformers peers: `generate` on static batches (hf-static) and transformers' own
continuous batching (hf-cb). Run by benchmark/peer_worker.py in the project's virtualenv."""

from __future__ import annotations

import argparse
import logging
import platform
import time
from collections import deque
from pathlib import Path

from benchmark.peer_protocol import FIRST_TOKENS, record, warmup_requests

logger = logging.getLogger("peer_worker")

# Tokens per page of transformers' paged cache: its own default (ContinuousBatchingConfig), which
# flash attention's paged decode path also wants; batchyard's blocks are its own choice (16).
HF_PAGE_SIZE = 256


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


def hf_block_bytes(model_config, dtype) -> int:
    """Bytes of one of transformers' cache blocks (a page of K and V in every layer), by its own
    arithmetic (PagedAttentionCache's bytes_per_block, the unit of ContinuousBatchingConfig's
    num_blocks). Full-attention models only, as batchyard's Llama peers are."""
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )
    from transformers.generation.continuous_batching.utils import (
        find_head_dim,
        find_num_key_value_heads,
    )

    page = FullAttentionCacheAllocator.get_bytes_per_page(
        find_num_key_value_heads(model_config), find_head_dim(model_config), dtype, HF_PAGE_SIZE)
    return model_config.num_hidden_layers * page


def hf_cb_settings(model_config, dtype, requests: list[dict], concurrency: int,
                   kv_cache_bytes: int | None) -> dict:
    """ContinuousBatchingConfig's arguments. A KV budget in bytes becomes num_blocks, rounded up
    to a whole block so the peer never holds fewer tokens than batchyard's pool of those bytes;
    without one, room for the C longest requests (+10 %): the CPU default is 90 % of all RAM,
    zeroed at start. Block sharing (prefix caching) off, like the other engines here."""
    if kv_cache_bytes:
        blocks = -(-kv_cache_bytes // hf_block_bytes(model_config, dtype))
    else:
        longest = max(len(r["prompt_ids"]) + r["new_tokens"] for r in requests)
        blocks = concurrency * (-(-longest // HF_PAGE_SIZE) + 1) * 11 // 10 + 1
    return {"page_size": HF_PAGE_SIZE, "num_blocks": blocks,
            "max_requests_per_batch": concurrency, "allow_block_sharing": False}


def hf_cb_manager(model, requests: list[dict], concurrency: int,
                  kv_cache_bytes: int | None = None):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    settings = hf_cb_settings(model.config, model.dtype, requests, concurrency, kv_cache_bytes)
    logger.info("transformers continuous batching: %s", settings)
    config = GenerationConfig(do_sample=False, eos_token_id=-1,
                              max_new_tokens=max(r["new_tokens"] for r in requests))
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=ContinuousBatchingConfig(**settings))
    manager.start()
    return manager


def hf_cb_pool(manager, model) -> dict:
    """The cache transformers built (read once it ran: its thread builds it), in tokens, and
    the attention it switched to; {} for what this transformers does not expose."""
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    pool: dict = {"attention": str(getattr(model.config, "_attn_implementation", "") or "")}
    if cache is not None and getattr(cache, "num_blocks", None):
        pool.update(kv_tokens=int(cache.num_blocks) * HF_PAGE_SIZE, kv_block_size=HF_PAGE_SIZE)
    return pool


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
    manager = hf_cb_manager(model, requests, args.concurrency, args.kv_cache_bytes)
    try:
        hf_cb_loop(manager, warmup_requests(requests, args.concurrency), args.concurrency)
        startup = time.perf_counter() - args.t0
        pool = hf_cb_pool(manager, model)
        results, first = hf_cb_loop(manager, requests, args.concurrency)
    finally:
        manager.stop(block=True, timeout=60)
    return {"startup_s": startup, "requests": results, "first_tokens": first[:FIRST_TOKENS],
            "versions": hf_versions(), "threads": args.threads,
            "kv_cache_bytes": args.kv_cache_bytes, **pool}
