"""Gemma 1/2/3 (text) on the Llama runner: the same fused projections, KV pool and sharding,
with Gemma's differences. RMSNorm scales by (1 + weight) in float32; embeddings are scaled by
sqrt(hidden); the MLP gates with tanh-approximated GELU. The rest is read from the model's
record (registry.py): Gemma 2/3 add norms after attention and around the MLP, scale queries by
query_pre_attn_scalar, alternate sliding-window and full layers (each attends through its
window's metadata) and soft-cap attention scores (explicit attention) and final logits where
the config sets caps (Gemma 2's does); Gemma 3 norms q and k per head and rotates its sliding
layers with a RoPE base of their own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.explicit import explicit_attention
from engine.attention.reference import AttentionMetadata
from engine.models.layers import ROPE_TYPES, rope_tables, rope_type
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.models.registry import model_record
from engine.models.spec import ModelSpec
from engine.models.windows import layer_types

ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # -> F.gelu's `approximate`


def activation(arch: str, config: dict) -> str:
    """The record's activation key: Gemma 2/3 read `hidden_activation`; Gemma 1 reads
    `hidden_act`, whose "gelu" in the official configs means the tanh approximation
    (transformers rewrites it so)."""
    if model_record(arch).activation_key == "hidden_activation":
        return config.get("hidden_activation") or "gelu_pytorch_tanh"
    act = config.get("hidden_act") or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: (x * (1 + w)) in float32, then cast: transformers' order for Gemma
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def rope_config(config: dict, layer_type: str) -> dict:
    """The config RoPE tables are computed from for one layer type (a record with
    local_rope_base, Gemma 3, rotates sliding layers with a local base; transformers 5 nests
    both under `rope_parameters`)."""
    rope = config.get("rope_parameters") or {}
    if layer_type in rope:
        return {**config, "rope_parameters": rope[layer_type]}
    if layer_type == "sliding_attention" and model_record(
            config["architectures"][0]).local_rope_base:
        return {**config, "rope_parameters": {
            "rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}}
    return config


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec, config: dict, inter: int, comm, kind: str,
                 index: int) -> None:
        super().__init__(spec, config, inter, comm, index=index)  # its norms: _norm's
        eps, record = config.get("rms_norm_eps", 1e-6), model_record(spec.architecture)
        self.sandwiched = record.sandwich_norms
        if self.sandwiched:
            self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        scalar = config.get("query_pre_attn_scalar") if record.query_pre_attn_scalar else None
        self.scale = (scalar or spec.head_dim) ** -0.5
        self.softcap = config.get("attn_logit_softcapping") if record.soft_capping else None
        self.kind = kind
        self.window = config["sliding_window"] if kind == "sliding_attention" else None
        self.approximate = ACTIVATIONS[activation(spec.architecture, config)]

    def _norm(self, size: int, eps: float) -> nn.Module:
        return GemmaRMSNorm(size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor):
        out = self._attention(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        if not self.sandwiched:
            x = x + out
            return x + self._sum(self._mlp(self.post_attention_layernorm(x)))
        x = x + self.post_attention_layernorm(out)
        mlp = self._sum(self._mlp(self.pre_feedforward_layernorm(x)))
        return x + self.post_feedforward_layernorm(mlp)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                mine: AttentionMetadata) -> torch.Tensor:
        if self.softcap is None:
            return super()._attend(q, k_cache, v_cache, mine)
        if mine.backend.caps_scores:
            return mine.backend.forward(q, k_cache, v_cache, mine, self.scale, self.softcap)
        # the other backends' kernels do not cap scores
        return explicit_attention(q, k_cache, v_cache, mine, self.scale, self.softcap,
                                  self.window)

    def _mlp(self, h: torch.Tensor, decode_only: bool = False) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma, Gemma 2 and Gemma 3 (text). Gemma 2's soft-capped layers attend explicitly, so
    its decode runs eagerly (no CUDA graphs)."""

    embed_scale: torch.Tensor  # a buffer (init_rope), declared for the type checker

    def __init__(self, config: dict, spec: ModelSpec, shard=None, comm=None) -> None:
        super().__init__(config, spec, shard, comm)
        kinds = layer_types(config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(self.spec, config, self.inter // self.shard.size, comm, kind, i)
            for i, kind in enumerate(kinds))
        self.norm = GemmaRMSNorm(spec.hidden_size, config.get("rms_norm_eps", 1e-6))
        self.final_softcap = (config.get("final_logit_softcapping")
                              if self.record.soft_capping else None)
        # the padded decode path describes each window; explicit attention it does not run
        self.graph_safe = self.final_softcap is None and not any(
            layer.softcap is not None for layer in self.layers)

    def init_rope(self) -> None:
        """One RoPE table per layer type (Gemma 3's sliding layers have a base of their own) and the
        embedding scale."""
        spec, device = self.spec, self.embed_tokens.weight.device
        for kind in sorted(set(layer_types(self.config))):  # (before the layers are Gemma's)
            cos, sin = rope_tables(rope_config(self.config, kind), spec.head_dim,
                                   spec.max_position_embeddings, device)
            self.register_buffer(f"rope_cos_{kind}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{kind}", sin, persistent=False)
        # float32 like transformers' (rounded to the model's dtype where it is used); made
        # here, not per step: a tensor born in forward is a host copy CUDA graphs refuse
        self.register_buffer("embed_scale", torch.tensor(spec.hidden_size ** 0.5, device=device),
                             persistent=False)

    @staticmethod
    def unsupported(arch: str, config: dict) -> str | None:
        act = activation(arch, config)
        if act not in ACTIVATIONS:
            return f"its activation {act!r} (native: {', '.join(ACTIVATIONS)})"
        kinds = set(layer_types(config))
        if kinds - {"full_attention", "sliding_attention"}:
            return f"its layer types {sorted(kinds)}"
        for kind in kinds:
            if rope_type(rope_config(config, kind)) not in ROPE_TYPES:
                return f"its rope type {rope_type(rope_config(config, kind))!r}"
        return None

    @staticmethod
    def spec_from_config(arch: str, config: dict) -> ModelSpec:
        flat = {**config, "use_sliding_window": False}  # windows are per layer here
        spec = LlamaForCausalLM.spec_from_config(arch, flat)
        windows = tuple(config["sliding_window"] if kind == "sliding_attention" else None
                        for kind in layer_types(config))
        if len(set(windows)) == 1:
            return replace(spec, sliding_window=windows[0])
        return replace(spec, layer_windows=windows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: Sequence[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions [N]; kv_cache: each layer's [2, slots, Hkv, D] → hidden
        [N, hidden]."""
        x = self._embed(input_ids)
        x = x * self.embed_scale.to(x.dtype)
        tables = {kind: (getattr(self, f"rope_cos_{kind}")[positions].to(x.dtype).unsqueeze(1),
                         getattr(self, f"rope_sin_{kind}")[positions].to(x.dtype).unsqueeze(1))
                  for kind in {layer.kind for layer in self.layers}}  # [N, 1, R] each
        exchange = meta.kv_exchange
        for i, (layer, layer_cache) in enumerate(zip(self.layers, kv_cache, strict=True)):
            if exchange is not None:
                exchange.before_layer(i)
            x = layer(x, *tables[layer.kind], meta, layer_cache[0], layer_cache[1])
            if exchange is not None:
                exchange.after_layer(i)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [S, vocab] float32
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def use_fused_cpu_ops(self, ops) -> None:
        """The C RMSNorm is Llama's (weight x normalised): Gemma's layers keep PyTorch ops."""
        for layer in self.layers:
            cast(GemmaDecoderLayer, layer).fused = None
