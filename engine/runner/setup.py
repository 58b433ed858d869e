"""What every rank builds alike: its shard of the model, its part of the KV pool, the start-up
checks. Rank 0 adds the tokenizer and the scheduler (LLMEngine.from_config); tensor-parallel
worker ranks (engine/core/tp_worker.py) only this."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.select import select_attention_backend
from engine.config import EngineConfig
from engine.kernels.triton_setup import TritonUnavailable, import_triton
from engine.kv.budget import KVPlan, default_budget_bytes, plan_kv
from engine.kv.layout import kv_layout
from engine.lora.errors import AdapterError
from engine.lora.manager import AdapterRegistry
from engine.lora.runtime import LoraRuntime
from engine.models.cpu_fused import FusedOps, fused_ops_for
from engine.models.linear import pack_model_linears
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model, resolve_device, resolve_dtype, spec_from_files
from engine.models.registry import native_names
from engine.models.spec import ModelSpec
from engine.models.triton_fused import triton_fused_ops_for
from engine.parallel.comm import STARTUP_TIMEOUT, Collectives
from engine.parallel.shard import Shard
from engine.runner.attention_check import prepare_attention
from engine.runner.graphs.setup import prepare_decode_graphs
from engine.runner.graphs.whole_step import graph_rows
from engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class RankSetup:
    runner: ModelRunner
    spec: ModelSpec  # what this rank holds (its heads); vocab_size is the whole vocabulary
    kv: KVPlan
    max_model_len: int


def settle_triton_mode(config: EngineConfig) -> None:
    """Import Triton for this engine's device now, when its kernels will run (the triton
    attention backend): Triton fixes at its first import whether it compiles or interprets
    (engine/kernels/triton_setup.py), and loading a tokenizer imports torch's compiler, which
    imports Triton compiled. Failures are select_attention_backend's to report."""
    if config.attention_backend != "triton":
        return
    try:
        import_triton(resolve_device(config.device))
    except TritonUnavailable:
        pass


def rank_device(config: EngineConfig, shard: Shard) -> torch.device:
    """The device of `shard`'s rank: GPU number rank on CUDA. On CPU the ranks share the
    cores, each taking its part of them."""
    device = resolve_device(config.device)
    if device.type == "cuda" and not shard.is_whole:
        torch.cuda.set_device(shard.rank)
        return torch.device("cuda", shard.rank)
    if device.type == "cpu" and not shard.is_whole:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // shard.size))
    return device


def build_rank(config: EngineConfig, device: torch.device, shard: Shard | None = None,
               comm: Collectives | None = None,
               loaded: Callable[[], None] | None = None) -> RankSetup:
    """Load this rank's shard, size the KV pool (the same block count on every rank), and run
    the start-up checks of attention, packed matmuls and decode graphs. `loaded` runs between
    the load and the first collective (tensor parallelism: a worker reports, rank 0 waits for
    every worker's report)."""
    shard = shard or Shard()
    dtype = resolve_dtype(config.dtype, device)
    model, spec = load_model(config.model, dtype, device, shard, comm, config.trust_remote_code,
                             config.model_impl, config.quantize)
    if loaded is not None:
        loaded()
    pack_model_linears(model, config, device, dtype)
    max_model_len = _max_model_len(config, spec.max_position_embeddings)
    budget = default_budget_bytes(device.type, config.gpu_memory_utilization)
    if comm is not None:  # every rank holds the same blocks: size them by the tightest rank
        budget = comm.agree_min(budget // shard.size if device.type == "cpu" else budget)
    kv = _plan_pool(config, spec, dtype, max_model_len, budget)
    layout = kv.layout
    if layout.is_hybrid:
        logger.info("KV groups: %d block tables over %d pool tensors (windows %s); windowed "
                    "tables free what sequences slide past", layout.num_tables,
                    layout.num_tensors, "/".join(str(w) for w in layout.group_windows))
    runner = ModelRunner(model, spec, device, dtype, kv.num_blocks, kv.block_size,
                         select_attention_backend(config.attention_backend, device), layout)
    # the most tokens one step holds: the configured budget, else every sequence at full length
    max_step_tokens = config.max_num_batched_tokens or config.max_num_seqs * max_model_len
    if config.enable_lora:
        _attach_lora(config, runner, dtype, graph_rows(config.max_num_seqs, max_step_tokens),
                     rank_zero=shard is None or shard.rank == 0)
    prepare_attention(runner, config.attention_backend, config.max_num_seqs, max_step_tokens,
                      max_model_len)
    if hasattr(model, "use_fused_cpu_ops"):
        ops: FusedOps | None = (
            triton_fused_ops_for(model, dtype, device) if runner.attention.name == "triton"
            else fused_ops_for(model, dtype, runner.attention.name))
        model.use_fused_cpu_ops(ops)
        runner.use_greedy_kernel(ops.greedy if ops is not None else None)
    if hasattr(model, "use_dense_moe_decode"):  # expert models: graph-safe decode on GPUs
        model.use_dense_moe_decode(device.type == "cuda" or config.padded_decode_on_cpu)
    eager = (config.enforce_eager or config.cudagraph_mode == "none"
             or not getattr(model, "graph_safe", True))
    prompt_rows = getattr(model, "pads_prompt_rows", True)
    rows = (graph_rows(config.max_num_seqs, max_step_tokens) if prompt_rows
            else config.max_num_seqs)
    graphs = prepare_decode_graphs(runner, eager, rows, max_model_len,
                                   config.padded_decode_on_cpu, prompt_rows, config.max_num_seqs,
                                   shrink_on_oom=comm is None,
                                   piecewise=comm is None
                                   and config.cudagraph_mode == "full_and_piecewise")
    # a collective, so every rank asks, whatever its own answer
    if comm is not None and not comm.agree_all(graphs) and graphs:
        logger.warning("CUDA graphs off: another tensor-parallel rank could not use them")
        runner.use_padded_decode(None)
    return RankSetup(runner, spec, kv, max_model_len)


def _attach_lora(config: EngineConfig, runner: ModelRunner, dtype: torch.dtype, max_rows: int,
                 rank_zero: bool) -> None:
    """LoRA slots in every layer the adapters may target; on rank 0 the registry, with the
    adapters given at start-up (a bad one stops the start, naming it and why)."""
    model = runner.model
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError("invalid enable_lora=true: LoRA adapters are served on the native "
                         f"models ({native_names()}), not on the transformers "
                         "fallback")
    lora = LoraRuntime(model, config.max_loras, config.max_lora_rank, runner.device, dtype,
                       max_rows)
    registry = None
    if rank_zero:
        registry = AdapterRegistry(config.max_lora_rank, config.max_cpu_loras or
                                   config.max_loras, lora.check)
        for name, path in config.lora_modules:
            try:
                registry.register(name, path)
            except AdapterError as err:
                raise ValueError(f"invalid lora_modules: {err}") from err
        logger.info("LoRA: %d slots of rank %d; adapters at start-up: %s", config.max_loras,
                    config.max_lora_rank, ", ".join(n for n, _ in config.lora_modules) or
                    "none")
    runner.use_lora(lora, registry)


def _plan_pool(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, max_model_len: int,
               default_budget: int) -> KVPlan:
    """The KV pool of `spec`'s rank: its layout (a block table per layer group under paged
    batching) and its blocks (plan_kv)."""
    layout = kv_layout(spec.windows, not config.is_contiguous and config.kv_groups,
                       max_model_len, config.block_size)
    return plan_kv(config, max_model_len, spec.kv_bytes_per_token(dtype, layout.num_tensors),
                   default_budget, layout)


def _max_model_len(config: EngineConfig, model_max: int) -> int:
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ValueError(f"invalid max_model_len={config.max_model_len}: must be <= the model's "
                         f"max_position_embeddings ({model_max})")
    return config.max_model_len


def check_before_load(config: EngineConfig, size: int) -> None:
    """What config.json alone answers, checked before any rank starts or loads weights (the
    same checks build_rank makes after the load): max_model_len against the model's positions,
    and a pool sized by num_kv_blocks / kv_cache_memory against the blocks a sequence needs.
    A model only its load describes (the transformers fallback), or a pool sized by the
    device's free memory, is checked after the load."""
    spec = spec_from_files(config.model, config.model_impl, Shard(0, size))
    if spec is None:
        return
    max_model_len = _max_model_len(config, spec.max_position_embeddings)
    if config.num_kv_blocks is None and config.kv_cache_memory is None:
        return
    _plan_pool(config, spec, resolve_dtype(config.dtype, resolve_device(config.device)),
               max_model_len, 0)


def build_rank_zero(config: EngineConfig) -> RankSetup:
    """This process's rank: the whole model, or rank 0 of `tensor_parallel_size` with the
    worker ranks started beside it (the runner's `peers`)."""
    size = tensor_parallel_size(config)
    check_before_load(config, size)
    if size == 1:
        return build_rank(config, rank_device(config, Shard()))
    from engine.parallel.comm import init_group, leave_group
    from engine.runner.tp_workers import WorkerGroup

    workers = WorkerGroup(config, size)
    try:
        shard = Shard(0, size)
        device = rank_device(config, shard)
        # a worker gone before the rendezvous or the first collective would leave this rank
        # waiting there for it (STARTUP_TIMEOUT): its reports come first
        workers.wait_for("joining", STARTUP_TIMEOUT.total_seconds())
        comm = init_group(shard, device, workers.store_path)
        setup = build_rank(config, device, shard, comm, loaded=lambda: workers.wait_for(
            "loaded", STARTUP_TIMEOUT.total_seconds()))
        comm.serving_timeout(config.collective_timeout_s)
    except BaseException:
        workers.kill()  # they may wait in a start-up collective for this rank
        workers.stop()
        leave_group()
        raise
    setup.runner.use_peers(workers)
    return setup


def tensor_parallel_size(config: EngineConfig) -> int:
    """The configured degree; -1 is every visible GPU (1 on CPU). ValueError past the GPUs."""
    size, device = config.tensor_parallel_size, resolve_device(config.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if size == -1:
        return max(gpus, 1)
    if device.type == "cuda" and size > gpus:
        raise ValueError(f"invalid tensor_parallel_degree={size}: {gpus} GPUs are visible")
    return size
