"""Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU; packed tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.reference import AttentionMetadata, store_kv
from engine.models.cpu_fused import FusedCpuOps
from engine.models.layers import RMSNorm, apply_rope, rope_inv_freq
from engine.models.linear import linear_factory, pack_linears, packed_checked
from engine.models.spec import ModelSpec


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, config: dict) -> None:
        super().__init__()
        self.spec = spec
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        bias = config.get("attention_bias", spec.architecture == "Qwen2ForCausalLM")
        self.qkv_proj = nn.Linear(spec.hidden_size, q + 2 * kv, bias=bias)
        self.o_proj = nn.Linear(q, spec.hidden_size, bias=config.get("attention_bias", False))
        inter, mlp_bias = config["intermediate_size"], config.get("mlp_bias", False)
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * inter, bias=mlp_bias)
        self.down_proj = nn.Linear(inter, spec.hidden_size, bias=mlp_bias)
        self.rotated_heads = spec.num_heads + spec.num_kv_heads  # q's and k's
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)
        self.scale = spec.head_dim ** -0.5
        self.fused: FusedCpuOps | None = None  # set by use_fused_cpu_ops

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor):
        if self.fused is not None:
            return self._forward_fused(x, cos, sin, meta, k_cache, v_cache)
        s = self.spec
        qkv = self.qkv_proj(self.input_layernorm(x))  # [N, (H + 2 Hkv) * D]
        # q and k are rotated in one pass (half the small ops of rotating each on its own)
        qk = qkv[:, :self.rotated_heads * s.head_dim].view(-1, self.rotated_heads, s.head_dim)
        q, k = apply_rope(qk, cos, sin).split([s.num_heads, s.num_kv_heads], dim=1)
        v = qkv[:, self.rotated_heads * s.head_dim:].view(-1, s.num_kv_heads, s.head_dim)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)  # q [N, H, D], k and v [N, Hkv, D]
        attn = meta.backend.forward(q, k_cache, v_cache, meta, self.scale)
        x = x + self.o_proj(attn.flatten(1))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """The same layer with RMSNorm (+ residual add) and RoPE (+ KV write) as one C call
        each (engine/models/cpu_fused.py); CPU, float32."""
        ops, norm1, norm2 = self.fused, self.input_layernorm, self.post_attention_layernorm
        qkv = self.qkv_proj(ops.rms_norm(x, norm1.weight, norm1.eps))
        q = ops.rope_store(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                           self.spec.num_heads)
        attn = meta.backend.forward(q, k_cache, v_cache, meta, self.scale)
        out = self.o_proj(attn.flatten(1))  # [N, hidden]: the norm adds x to it in place
        h = ops.rms_norm(out, norm2.weight, norm2.eps, residual=x)
        x = out  # x + o_proj(attn), bit for bit (float addition commutes)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions, meta, kv_cache) → hidden; compute_logits(hidden) → fp32."""

    def __init__(self, config: dict, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, config) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, config.get("rms_norm_eps", 1e-6))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            spec.hidden_size, spec.vocab_size, bias=False)
        # NOTE: kept float32 whatever the model dtype, like transformers' rotary embedding.
        freqs = torch.outer(torch.arange(spec.max_position_embeddings, dtype=torch.float32),
                            rope_inv_freq(config, spec.head_dim))
        self.register_buffer("rope_cos", torch.cat([freqs, freqs], -1).cos(), persistent=False)
        self.register_buffer("rope_sin", torch.cat([freqs, freqs], -1).sin(), persistent=False)

    @staticmethod
    def spec_from_config(arch: str, config: dict) -> ModelSpec:
        heads = config["num_attention_heads"]
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        return ModelSpec(
            architecture=arch, num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            sliding_window=window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [N]; kv_cache [layers, 2, slots, Hkv, D] → hidden [N, hidden]."""
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [N, 1, D]
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        for layer, layer_cache in zip(self.layers, kv_cache, strict=True):
            x = layer(x, cos, sin, meta, layer_cache[0], layer_cache[1])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] → logits [S, vocab] float32."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def use_fused_cpu_ops(self, ops: FusedCpuOps | None) -> None:
        for layer in self.layers:
            layer.fused = ops

    def pack_linears(self, backend: str, batch_hint: int) -> int:
        """Every matmul through a packed CPU backend (engine.models.linear). A tied lm_head gets
        a packed copy of the embedding (vocab x hidden more memory), the lookup keeps the
        original."""
        tied = None
        if self.lm_head is None:
            tied = packed_checked(linear_factory(backend, batch_hint), self.embed_tokens.weight,
                                  None, "lm_head (tied)")
        count = pack_linears(self, backend, batch_hint)
        if tied is not None:
            self.lm_head, count = tied, count + 1
        return count

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up into one matmul each."""
        own = self.state_dict()
        for name, tensor in state.items():
            name = name.removeprefix("model.")
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, offset = _fused_target(name, self.spec, own)
            if target not in own:
                raise ValueError(f"unexpected weight {name} in checkpoint")
            own[target].narrow(0, offset, tensor.shape[0]).copy_(tensor)
        self.load_state_dict(own)


def _fused_target(name: str, spec: ModelSpec, own: dict) -> tuple[str, int]:
    """Where an HF tensor lands: (our parameter name, row offset into it)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    parts = {"self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", q),
             "self_attn.v_proj": ("qkv_proj", q + kv), "self_attn.o_proj": ("o_proj", 0),
             "mlp.gate_proj": ("gate_up_proj", 0), "mlp.down_proj": ("down_proj", 0)}
    for hf, (ours, offset) in parts.items():
        if f".{hf}." in name:
            return name.replace(hf, ours), offset
    if ".mlp.up_proj." in name:
        layer = name.split(".")[1]
        inter = own[f"layers.{layer}.gate_up_proj.weight"].shape[0] // 2
        return name.replace("mlp.up_proj", "gate_up_proj"), inter
    return name, 0
