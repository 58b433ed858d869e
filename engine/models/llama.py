"""Llama-family decoder (the records of family "llama" in registry.py: Llama, Mistral, Qwen2,
Qwen3, Phi-3, Mixtral, Qwen2/3-MoE): RMSNorm, RoPE, GQA, SwiGLU; packed tokens. What an
architecture does differently is read from its record, never from its name: q/k/v biases
(Qwen2), an RMSNorm over each q and k head before RoPE (Qwen3), fused checkpoint tensors
(Phi-3, placement.py), sparse experts in place of the MLP (moe.py), and which layers attend
within windows (windows.py). Config-borne settings stay in the config: a partly rotated head
and LongRoPE (Phi-3), rope scaling, biases a config names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.reference import AttentionMetadata, store_kv
from engine.models.cpu_fused import FusedOps
from engine.models.layers import (
    ROPE_TYPES,
    RMSNorm,
    apply_rope,
    long_rope_after,
    rope_tables,
    rope_type,
    rotary_dim,
)
from engine.models.linear import linear_factory, pack_linears, packed_checked
from engine.models.moe import SparseMoE, dense_layers, moe_settings
from engine.models.placement import Placement, llama_placements
from engine.models.registry import ModelRecord, model_record
from engine.models.spec import ModelSpec
from engine.models.windows import layer_windows
from engine.parallel.shard import Shard

if TYPE_CHECKING:
    from engine.parallel.comm import Collectives


class DecoderLayer(nn.Module):
    """`spec` holds this rank's heads; `inter` its intermediate rows. With `comm`, o_proj and
    down_proj hold this rank's input columns and their outputs are summed over the ranks."""

    def __init__(self, spec: ModelSpec, config: dict, inter: int,
                 comm: Collectives | None = None, window: int | None = None,
                 shared_inter: int = 0, index: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.index = index  # the layer's number: which attention group's metadata it reads
        self.comm = comm
        record = model_record(spec.architecture)
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        bias = config.get("attention_bias", config.get("qkv_bias", record.qkv_bias))
        self.qkv_proj = nn.Linear(spec.hidden_size, q + 2 * kv, bias=bias)
        self.o_proj = nn.Linear(q, spec.hidden_size, bias=config.get("attention_bias", False))
        mlp_bias = config.get("mlp_bias", False)
        moe = moe_settings(config, record.moe)
        self.moe = None if moe is None else SparseMoE(
            spec.hidden_size, inter, moe, shared_inter)
        if self.moe is None:
            self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * inter, bias=mlp_bias)
            self.down_proj = nn.Linear(inter, spec.hidden_size, bias=mlp_bias)
        self.rotated_heads = spec.num_heads + spec.num_kv_heads  # q's and k's
        self.rotary_dim = rotary_dim(config, spec.head_dim)  # leading dims of a head rotated
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = self._norm(spec.hidden_size, eps)
        self.post_attention_layernorm = self._norm(spec.hidden_size, eps)
        self.scale = spec.head_dim ** -0.5
        self.window = window  # None: full attention
        self.fused: FusedOps | None = None  # set by use_fused_cpu_ops
        # Qwen3, Gemma 3: one RMSNorm over the head dimension for q heads, one for k heads
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if record.qk_norm:
            self.q_norm, self.k_norm = self._norm(spec.head_dim, eps), self._norm(
                spec.head_dim, eps)

    def _norm(self, size: int, eps: float) -> nn.Module:
        """The family's RMSNorm (Gemma's scales by 1 + weight)."""
        return RMSNorm(size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor):
        if self.fused is not None:
            return self._forward_fused(x, cos, sin, meta, k_cache, v_cache)
        x = x + self._attention(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self._sum(self._mlp(self.post_attention_layernorm(x), not meta.prefills))

    def _attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] (normed) → o_proj's output [N, hidden], summed over the ranks; writes
        the step's K and V into the pool."""
        s = self.spec
        qkv = self._norm_heads(self.qkv_proj(h))  # [N, (H + 2 Hkv) * D]
        # q and k are rotated in one pass (half the small ops of rotating each on its own)
        qk = qkv[:, :self.rotated_heads * s.head_dim].view(-1, self.rotated_heads, s.head_dim)
        q, k = self._rope(qk, cos, sin).split([s.num_heads, s.num_kv_heads], dim=1)
        v = qkv[:, self.rotated_heads * s.head_dim:].view(-1, s.num_kv_heads, s.head_dim)
        mine = meta.for_layer(self.index, self.window)
        store_kv(k, v, k_cache, v_cache, mine.slot_mapping)  # q [N, H, D], k and v [N, Hkv, D]
        attn = self._attend(q, k_cache, v_cache, mine)
        return self._sum(self.o_proj(attn.flatten(1)))

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                mine: AttentionMetadata) -> torch.Tensor:
        """Attention over the pool; `mine`: this layer's attention group's metadata."""
        return mine.backend.forward(q, k_cache, v_cache, mine, self.scale)

    def _mlp(self, h: torch.Tensor, decode_only: bool = False) -> torch.Tensor:
        """[N, hidden] → [N, hidden], this rank's share: SwiGLU, or the sparse experts'."""
        if self.moe is not None:
            return self.moe(h, decode_only)
        gate_up = self.gate_up_proj(h)  # [N, 2 I]
        silu_mul = getattr(self.fused, "silu_mul", None)  # the Triton ops fuse it
        if silu_mul is not None:
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk [N, heads, D] rotated in its first rotary_dim dimensions (cos/sin [N, 1, R])."""
        if self.rotary_dim == qk.shape[-1]:
            return apply_rope(qk, cos, sin)
        rotated, kept = qk.split([self.rotary_dim, qk.shape[-1] - self.rotary_dim], dim=-1)
        return torch.cat([apply_rope(rotated, cos, sin), kept], dim=-1)

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head q and k norms, in place in qkv [N, (H + 2 Hkv) * D] (so the fused
        RoPE + KV write reads them); other models: qkv as it is."""
        if self.q_norm is None or self.k_norm is None:
            return qkv
        s = self.spec
        q = qkv[:, :s.num_heads * s.head_dim].view(-1, s.num_heads, s.head_dim)
        k = qkv[:, s.num_heads * s.head_dim:self.rotated_heads * s.head_dim].view(
            -1, s.num_kv_heads, s.head_dim)
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))
        return qkv

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over the ranks (itself on one rank)."""
        return partial if self.comm is None else self.comm.all_reduce(partial)

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """The same layer with RMSNorm (+ residual add) and RoPE (+ KV write) as one C call
        each (engine/models/cpu_fused.py); CPU, float32."""
        # the fused ops are only set on layers of Llama's RMSNorm (Gemma's keep PyTorch ops)
        ops = self.fused
        assert ops is not None  # forward() comes here only with them
        norm1 = cast(RMSNorm, self.input_layernorm)
        norm2 = cast(RMSNorm, self.post_attention_layernorm)
        qkv = self._norm_heads(self.qkv_proj(ops.rms_norm(x, norm1.weight, norm1.eps)))
        mine = meta.for_layer(self.index, self.window)
        q = ops.rope_store(qkv, cos, sin, k_cache, v_cache, mine.slot_mapping,
                           self.spec.num_heads)
        attn = self._attend(q, k_cache, v_cache, mine)
        out = self._sum(self.o_proj(attn.flatten(1)))  # [N, hidden]: the norm adds x in place
        h = ops.rms_norm(out, norm2.weight, norm2.eps, residual=x)
        x = out  # x + o_proj(attn), bit for bit (float addition commutes)
        return x + self._sum(self._mlp(h, not meta.prefills))


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions, meta, kv_cache) → hidden; compute_logits(hidden) → fp32.

    Sharded over tensor-parallel ranks when given a Shard and its Collectives: `spec` is then
    this rank's part (its heads), `full_spec` the checkpoint's."""

    # forward() calls a step's LayerExchange between layers (cooperative prefill)
    exchanges_kv = True

    rope_cos: torch.Tensor  # buffers (init_rope), declared for the type checker
    rope_sin: torch.Tensor
    quantization: str | None = None  # what a pre-quantized checkpoint holds (the loader sets it)

    def __init__(self, config: dict, spec: ModelSpec, shard: Shard | None = None,
                 comm: Collectives | None = None) -> None:
        super().__init__()
        self.shard, self.comm = shard or Shard(), comm
        shard = self.shard
        self.config = config
        self.full_spec = spec
        # what this architecture does differently (registry.py)
        self.record: ModelRecord = model_record(spec.architecture)
        moe = moe_settings(config, self.record.moe)
        # the experts' intermediate size for a MoE model: its MLPs are the experts
        self.inter = inter = moe.inter if moe else config["intermediate_size"]
        # expert routing reads the router's choice on the host: decode runs eagerly, unless
        # use_dense_moe_decode(True)
        self.syncs_host = moe is not None
        self.graph_safe = not self.syncs_host
        # whether a step's rows are worth padding when they include prompt tokens: a dense
        # expert decode runs every expert on every row (E / top_k times the routed work)
        self.pads_prompt_rows = moe is None
        shard.check(spec.num_heads, spec.num_kv_heads, inter)
        if moe is not None and moe.shared_inter:
            shard.check(spec.num_heads, spec.num_kv_heads, moe.shared_inter)
        self.spec = spec.of_rank(shard)
        self.vocab = shard.vocab(spec.vocab_size)  # the token ids of this rank's rows
        vocab_rows = shard.vocab_rows(spec.vocab_size)
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)
        # given its (empty) weight, the embedding skips its random init: the checkpoint fills
        # it, and torch.nn.init.normal_ would import TorchDynamo on first use (~2.5 s of start-up)
        self.embed_tokens = nn.Embedding(vocab_rows, spec.hidden_size,
                                         _weight=torch.empty(vocab_rows, spec.hidden_size))
        windows = spec.layer_windows or [spec.sliding_window] * spec.num_layers
        shared = moe.shared_inter // shard.size if moe else 0  # this rank's shared expert rows
        self.layers = nn.ModuleList(DecoderLayer(self.spec, config, inter // shard.size, comm,
                                                 window, shared, i)
                                    for i, window in enumerate(windows))
        self.norm: nn.Module = RMSNorm(spec.hidden_size, config.get("rms_norm_eps", 1e-6))
        self.lm_head: nn.Module | None = None if self.tie_word_embeddings else nn.Linear(
            spec.hidden_size, vocab_rows, bias=False)
        if self.embed_tokens.weight.device.type != "meta":  # else the loader calls it once real
            self.init_rope()

    def init_rope(self) -> None:
        """The RoPE tables, computed where the embedding lives (again after a meta-device build).
        NOTE: float32 whatever the model dtype, like transformers' rotary embedding."""
        spec, device = self.spec, self.embed_tokens.weight.device
        cos, sin = rope_tables(self.config, spec.head_dim, spec.max_position_embeddings, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [positions, rotary_dim]
        self.register_buffer("rope_sin", sin, persistent=False)

    @staticmethod
    def unsupported(arch: str, config: dict) -> str | None:
        """What in this config the native modules cannot run (None: they run all of it)."""
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            return f"its activation {act!r} (native: silu)"
        if dense_layers(config, model_record(arch).moe):
            return "dense MLP layers among its expert layers (mlp_only_layers, " \
                "decoder_sparse_step)"
        kind = rope_type(config)
        if kind not in ROPE_TYPES:
            return f"its rope type {kind!r} (native: {', '.join(ROPE_TYPES)})"
        try:
            layer_windows(arch, config)
        except ValueError as err:
            return str(err)
        return None

    @staticmethod
    def spec_from_config(arch: str, config: dict) -> ModelSpec:
        heads = config["num_attention_heads"]
        windows = layer_windows(arch, config)
        uniform = len(set(windows)) == 1
        return ModelSpec(
            architecture=arch, num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            sliding_window=windows[0] if uniform else None,
            layer_windows=None if uniform else tuple(windows),
            rope_long_after=long_rope_after(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: Sequence[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions [N]; kv_cache: each layer's [2, slots, Hkv, D] → hidden
        [N, hidden]."""
        x = self._embed(input_ids)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [N, 1, D]
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        exchange = meta.kv_exchange
        for i, (layer, layer_cache) in enumerate(zip(self.layers, kv_cache, strict=True)):
            if exchange is not None:
                exchange.before_layer(i)
            x = layer(x, cos, sin, meta, layer_cache[0], layer_cache[1])
            if exchange is not None:
                exchange.after_layer(i)
        return self.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N] → [N, hidden]; sharded, each rank looks up the ids its rows hold and the ranks'
        rows are summed (every other rank contributes zeros)."""
        if self.comm is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))  # [N]
        x = self.embed_tokens(local.masked_fill(outside, 0))  # [N, hidden]
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] → logits [S, vocab] float32 (sharded: gathered once)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.comm is not None:
            logits = self.comm.gather_vocab(logits, self.full_spec.vocab_size)
        return logits.float()

    def use_dense_moe_decode(self, on: bool) -> None:
        """Expert models: run pure decode steps densely (moe.py), which makes them graph-safe
        and free of host reads; otherwise routing reads the host and decode runs eagerly."""
        if self.layers[0].moe is None:
            return
        for layer in self.layers:  # each has experts when the first has
            cast(SparseMoE, layer.moe).dense_decode = on
        self.graph_safe = on
        self.syncs_host = not on  # (prefill still reads the router's choice)

    def use_fused_cpu_ops(self, ops: FusedOps | None) -> None:
        """The C RoPE rotates whole heads: a partly rotated head keeps the PyTorch ops."""
        whole_heads = rotary_dim(self.config, self.spec.head_dim) == self.spec.head_dim
        for layer in self.layers:
            cast(DecoderLayer, layer).fused = ops if whole_heads else None

    def pack_linears(self, backend: str, batch_hint: int) -> int:
        """Every matmul through a packed CPU backend (engine.models.linear). A tied lm_head gets
        a packed copy of the embedding (vocab x hidden more memory), the lookup keeps the
        original."""
        if backend in ("int8", "fp8") and self.layers[0].moe is not None:
            raise ValueError(f"invalid quantize={backend!r}: the sparse experts of "
                             f"{self.spec.architecture} hold most of its weights and {backend} "
                             "does not cover them yet; serve it in bf16/fp16")
        if backend == "fp8":  # as vLLM's --quantization fp8: the LM head stays in full precision
            return pack_linears(self, backend, batch_hint, keep=("lm_head",))
        tied = None
        if self.lm_head is None:
            tied = packed_checked(linear_factory(backend, batch_hint), self.embed_tokens.weight,
                                  None, "lm_head (tied)")
        count = pack_linears(self, backend, batch_hint)
        if tied is not None:
            self.lm_head, count = tied, count + 1
        return count

    def weight_placements(self, name: str) -> list[Placement]:
        """Where the checkpoint tensor `name` lands on this rank (engine/models/placement.py)."""
        return llama_placements(self, name)

    def expected_rows(self) -> dict[str, int]:
        """Rows of each parameter the checkpoint must fill (a vocabulary slice's padding rows
        stay zero)."""
        rows = {name: p.shape[0] for name, p in self.named_parameters()}
        for name in ("embed_tokens.weight", "lm_head.weight"):
            if name in rows:
                rows[name] = len(self.vocab)
        return rows
