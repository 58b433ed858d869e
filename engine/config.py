"""EngineConfig: the user's knobs, frozen and validated. Start-up facts live in ModelSpec."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

BATCHING_STRATEGIES = ("none", "dynamic", "continuous", "paged")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
# auto: a fast kernel where one fits the device, else the pure-PyTorch reference
# (engine/attention/select.py).
ATTENTION_BACKENDS = ("auto", "reference", "flex", "cpu_paged", "triton")
# auto: packed CPU matmuls, our tiled kernel then oneDNN, else aten (engine/models/linear.py).
LINEAR_BACKENDS = ("auto", "tiled", "onednn", "aten")
# Who implements the model (vLLM's --model-impl): batchyard's native modules where the
# architecture has them, or transformers' own modules on batchyard's KV pool.
MODEL_IMPLS = ("auto", "native", "transformers")
# vLLM's CUDAGraphMode names: whole-step graphs, plus piecewise graphs for the steps past their
# gather bound (engine/runner/graphs/piecewise.py); whole-step graphs alone; none (enforce_eager)
CUDAGRAPH_MODES = ("full_and_piecewise", "full", "none")
# The max_lora_rank values vLLM allows (LMI passes the key to it): slots are this wide.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# option.quantize: int8 and fp8 quantize float weights at load (int8: weight-only; fp8: weights
# and activations, engine/quant/linear.py); awq, gptq, fp8 and compressed-tensors name a
# pre-quantized checkpoint's format (read from its config.json either way, engine/quant/).
QUANTIZATIONS = ("int8", "fp8", "awq", "gptq", "compressed-tensors")
# vLLM's / LMI's other spellings of those formats
QUANTIZE_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "marlin": "gptq",
                    "compressed_tensors": "compressed-tensors", "fbgemm_fp8": "fp8"}
# speculative_method: None (off) or a proposer engine/spec/ runs
SPECULATIVE_METHODS = (None, "ngram", "draft_model")
# A busy step holds this many sequences or more (max_num_seqs, if fewer); the gauges time busy
# steps alone: a step of one or two costs several times more per sequence (its fixed cost
# shared by few) and leaves the host idle anyway. The HTTP threads' CPU priority is decided on
# what busy steps cost (handler/cpu_priority.py).
BUSY_STEP_SEQUENCES = 8
# The KV transfer between disaggregated workers (vLLM's kv_connector vocabulary): blocks move
# over torch.distributed point to point, gloo through host memory or NCCL between GPUs.
KV_CONNECTORS = ("TorchDistributedConnector",)
KV_BUFFER_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Disaggregation:
    """Prefill and decode on separate worker processes (engine/disagg/, DistServe): prefill
    workers compute a prompt's KV and first token and hand the KV to a decode worker; with two
    or more prefill workers a prompt of cooperative_prefill_threshold tokens or more is split
    across them (KV-Runahead). kv_ip/kv_port: the TCP store the workers meet at (0: a free
    port); kv_buffer_device: where KV is staged for the transfer (cpu: gloo; cuda: NCCL)."""

    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    kv_connector: str = "TorchDistributedConnector"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_buffer_device: str = "auto"
    cooperative_prefill_threshold: int | None = 2048
    transfer_timeout_s: float = 60.0
    # The partition's r (engine/disagg/runahead.py); None: from the model's shapes. A huge
    # value splits evenly (bench runahead compares).
    partition_linear_tokens: float | None = None
    # Workers on other hosts (`batchyard worker --router HOST:worker_port`, proving
    # worker_key): the last remote_prefill_workers of the prefill workers and the last
    # remote_decode_workers of the decode workers join from there.
    remote_prefill_workers: int = 0
    remote_decode_workers: int = 0
    worker_port: int = 0
    worker_key: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        _check(self.num_prefill_workers >= 1, "num_prefill_workers", self.num_prefill_workers,
               "an integer >= 1")
        _check(self.num_decode_workers >= 1, "num_decode_workers", self.num_decode_workers,
               "an integer >= 1")
        _check(self.kv_connector in KV_CONNECTORS, "kv_connector", self.kv_connector,
               f"one of {', '.join(KV_CONNECTORS)}")
        _check(0 <= self.kv_port < 65536, "kv_port", self.kv_port, "a TCP port (0: a free one)")
        _check(self.kv_buffer_device in KV_BUFFER_DEVICES, "kv_buffer_device",
               self.kv_buffer_device, f"one of {', '.join(KV_BUFFER_DEVICES)}")
        _check(self.cooperative_prefill_threshold is None
               or self.cooperative_prefill_threshold >= 2, "cooperative_prefill_threshold",
               self.cooperative_prefill_threshold, "None or an integer >= 2")
        _check(self.transfer_timeout_s > 0, "transfer_timeout_s", self.transfer_timeout_s,
               "> 0 seconds")
        _check(0 <= self.remote_prefill_workers < self.num_prefill_workers,
               "remote_prefill_workers", self.remote_prefill_workers,
               f"0..{self.num_prefill_workers - 1} (the first prefill worker runs here: it hosts "
               "the store the workers meet at)")
        _check(0 <= self.remote_decode_workers <= self.num_decode_workers,
               "remote_decode_workers", self.remote_decode_workers,
               f"0..num_decode_workers ({self.num_decode_workers})")
        remote = self.remote_prefill_workers + self.remote_decode_workers
        _check(not remote or 0 < self.worker_port < 65536, "worker_port", self.worker_port,
               "the TCP port remote workers reach the router at")
        _check(not remote or bool(self.worker_key), "worker_key", "(hidden)",
               "a shared secret when workers join from other hosts")

    @property
    def num_workers(self) -> int:
        return self.num_prefill_workers + self.num_decode_workers


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is asked to do. Field names follow vLLM where one exists."""

    model: str
    batching: str = "none"
    # Most sequences that hold KV at once: 1 for none, batch_size for dynamic,
    # max_rolling_batch_size for continuous/paged.
    max_num_seqs: int = 1
    # dynamic batching: how long the oldest waiting request waits for a full batch
    max_batch_delay_ms: float = 100.0
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # Token budget of one step (prefill + decode tokens). None: no cap for the contiguous
    # strategies; the paged scheduler picks its own default.
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    # KV pool size, one budget for every strategy: bytes, or an explicit block count.
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # auto: a fast kernel where one fits the device, else the pure-PyTorch reference.
    attention_backend: str = "auto"
    # auto: packed CPU matmuls (tiled kernel, then oneDNN), else aten; see LINEAR_BACKENDS.
    linear_backend: str = "auto"
    # Run every step eagerly: no CUDA graphs for decode (the vLLM / LMI key).
    enforce_eager: bool = False
    # Which CUDA graphs (CUDAGRAPH_MODES); "none" is enforce_eager.
    cudagraph_mode: str = "full_and_piecewise"
    # CI's stand-in for CUDA graphs: on CPU too, pure decode steps run padded to the graphs'
    # buckets over their static buffers, checked at start-up (slower on CPU; for tests).
    padded_decode_on_cpu: bool = False
    # Models mixing full and windowed layers under paged batching: a block table per
    # group of layers, so windowed layers keep only their window (engine/kv/layout.py; vLLM's
    # hybrid KV cache manager). False: one table, every layer keeps every position.
    kv_groups: bool = True
    # Plan step n+1 while step n computes (its tokens feed step n+1 on the device). None: on
    # where the device runs asynchronously to the host (CUDA) and one rank computes.
    async_scheduling: bool | None = None
    # None: weights in `dtype`, or as a pre-quantized checkpoint stores them; "int8"/"fp8":
    # quantized at load (one scale per output channel); a format name must match the checkpoint.
    quantize: str | None = None
    # Ranks the model is sharded over (Megatron-style, engine/parallel/); -1: every visible
    # GPU (1 on CPU).
    tensor_parallel_size: int = 1
    # A collective that waits longer for a peer rank raises: that rank is taken for hung.
    collective_timeout_s: float = 60.0
    seed: int = 0
    trust_remote_code: bool = False
    # auto: native when the architecture has a native implementation, else the transformers
    # fallback; native: refuse other architectures; transformers: the fallback for any.
    model_impl: str = "auto"
    # LoRA adapters (engine/lora/): requests name one of them, and their rows add its update
    # to the base layers' outputs. max_loras: distinct adapters in one step (device slots);
    # max_lora_rank: the largest rank served (slots are that wide); max_cpu_loras: adapters
    # kept read in host memory (None: max_loras); lora_modules: (name, folder) registered at
    # start-up.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Speculative decoding (engine/spec/): "ngram" (prompt lookup) or None; up to
    # num_speculative_tokens proposals per sequence and step, from the latest earlier match of
    # its last prompt_lookup_max..prompt_lookup_min tokens; none while more than
    # speculative_disable_batch_size sequences run.
    speculative_method: str | None = None
    speculative_model: str | None = None  # draft_model: the draft's folder (same tokenizer)
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    speculative_disable_batch_size: int | None = None
    # Disaggregated prefill and decode (engine/disagg/); None: one engine does both.
    disaggregation: Disaggregation | None = None

    def __post_init__(self) -> None:
        _check(self.batching in BATCHING_STRATEGIES, "batching", self.batching,
               f"one of {', '.join(BATCHING_STRATEGIES)}")
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "an integer >= 1")
        _check(self.batching != "none" or self.max_num_seqs == 1, "max_num_seqs",
               self.max_num_seqs, "1 when batching is none")
        _check(self.max_batch_delay_ms >= 0, "max_batch_delay_ms", self.max_batch_delay_ms, ">= 0")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               self.max_model_len, "an integer >= 2")
        _check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
               "max_num_batched_tokens", self.max_num_batched_tokens, "an integer >= 1")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        _check(self.device in DEVICES, "device", self.device, f"one of {', '.join(DEVICES)}")
        _check(self.block_size >= 1, "block_size", self.block_size, "an integer >= 1")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory",
               self.kv_cache_memory, "a positive number of bytes")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks",
               self.num_kv_blocks, "an integer >= 1")
        _check(self.quantize is None or self.quantize in QUANTIZATIONS, "quantize",
               self.quantize, f"None or one of {', '.join(QUANTIZATIONS)}")
        _check(self.tensor_parallel_size >= 1 or self.tensor_parallel_size == -1,
               "tensor_parallel_size", self.tensor_parallel_size, "an integer >= 1, or -1 (all)")
        _check(self.collective_timeout_s > 0, "collective_timeout_s", self.collective_timeout_s,
               "> 0 seconds")
        _check(self.model_impl in MODEL_IMPLS, "model_impl", self.model_impl,
               f"one of {', '.join(MODEL_IMPLS)}")
        _check(self.cudagraph_mode in CUDAGRAPH_MODES, "cudagraph_mode", self.cudagraph_mode,
               f"one of {', '.join(CUDAGRAPH_MODES)}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               self.gpu_memory_utilization, "a fraction in (0, 1]")
        _check(self.max_loras >= 1, "max_loras", self.max_loras, "an integer >= 1")
        _check(self.speculative_method in SPECULATIVE_METHODS, "speculative_method",
               self.speculative_method, "None, 'ngram' or 'draft_model'")
        _check((self.speculative_method == "draft_model") == (self.speculative_model is not None),
               "speculative_model", self.speculative_model,
               "a draft model's folder exactly when speculative_method is 'draft_model'")
        _check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens",
               self.num_speculative_tokens, "an integer in 1..16")
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
               self.prompt_lookup_min, f"an integer in 1..prompt_lookup_max "
               f"({self.prompt_lookup_max})")
        _check(self.speculative_disable_batch_size is None
               or self.speculative_disable_batch_size >= 1, "speculative_disable_batch_size",
               self.speculative_disable_batch_size, "None or an integer >= 1")
        _check(self.max_lora_rank in MAX_LORA_RANKS, "max_lora_rank", self.max_lora_rank,
               f"one of {', '.join(map(str, MAX_LORA_RANKS))}")
        _check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
               "max_cpu_loras", self.max_cpu_loras, f"an integer >= max_loras={self.max_loras}")
        _check(self.enable_lora or not self.lora_modules, "enable_lora", self.enable_lora,
               "true when adapters are given")
        if self.disaggregation is not None:
            self._check_disaggregation()

    def _check_disaggregation(self) -> None:
        """What disaggregated workers do not serve (yet): named by the key that asks for it."""
        _check(self.batching == "paged", "batching", self.batching,
               "paged with disaggregated prefill/decode (KV moves as blocks)")
        _check(self.tensor_parallel_size == 1, "tensor_parallel_size", self.tensor_parallel_size,
               "1 with disaggregated prefill/decode (each worker runs the whole model)")
        _check(not self.enable_lora, "enable_lora", self.enable_lora,
               "false with disaggregated prefill/decode")

    @property
    def busy_step_sequences(self) -> int:
        """Sequences that make a step busy (BUSY_STEP_SEQUENCES)."""
        return min(BUSY_STEP_SEQUENCES, self.max_num_seqs)

    @property
    def is_contiguous(self) -> bool:
        """Contiguous strategies reserve one max_model_len block per sequence."""
        return self.batching != "paged"


# A configuration error: ValueError("invalid <key>=<value>: <what is allowed>"). Its one line says
# all; a traceback would only bury it (start-up logs it so, in every process).
_CONFIG_ERROR = re.compile(r"invalid [\w.]+=")


def is_config_error(err: BaseException) -> bool:
    """Whether `err` is a configuration error (`invalid <key>=<value>: ...`)."""
    return isinstance(err, ValueError) and _CONFIG_ERROR.match(str(err)) is not None


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"invalid {field}={value!r}: must be {allowed}")
