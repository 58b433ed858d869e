"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks the top-k of E
SwiGLU experts for each token, and their outputs, weighted by the router's probabilities, are
summed; Qwen2-MoE adds a shared expert that every token takes, scaled by a sigmoid gate.

Two ways to run the experts. Sparse (prefill, and any step on CPU): each expert the batch uses
runs on its own tokens, which means reading the router's choice on the host. Dense (pure decode
steps where `dense_decode` is on: CUDA, or CI's padded path on CPU): every expert runs on every
token and the router's weights, zero for the experts not chosen, mix them, with no host read, so
the step can be captured in a CUDA graph and planned ahead. For a decode batch of a few tokens
that costs little (the step is memory-bound: every expert's weights are read once either way);
for large batches it computes E/k times the chosen experts' FLOPs.

The experts' weights are stacked in two 2-D parameters (expert e's rows start at e x its row
count), so the loader fills them like any fused tensor and, under tensor parallelism, each rank
holds every expert's share of the intermediate rows (its partial sums are all-reduced with the
layer's other row-parallel output)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.registry import MoeKind

# checkpoint names: Mixtral's block_sparse_moe.experts.E.w1/w3/w2, Qwen3-MoE's
# mlp.experts.E.gate_proj/up_proj/down_proj; and their routers
_EXPERT = re.compile(r"\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|"
                     r"down_proj)\.weight$")
_ROUTER = re.compile(r"\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_PROJECTIONS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
                "down_proj": "down"}


@dataclass(frozen=True)
class MoESettings:
    num_experts: int
    top_k: int
    inter: int  # one expert's intermediate size
    renormalise: bool  # the top-k probabilities rescaled to sum to 1
    cast_weights: bool  # the weights cast to the activations' dtype before use
    shared_inter: int = 0  # the shared expert's intermediate size (Qwen2-MoE; 0: none)


def moe_settings(config: dict, kind: MoeKind | None) -> MoESettings | None:
    """The experts of a sparse config (None for a dense model); `kind`: the model record's
    (registry.py). transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    if kind is None or not experts:
        return None
    if kind == "qwen":  # Qwen2-MoE, Qwen3-MoE
        return MoESettings(experts, config["num_experts_per_tok"],
                           config["moe_intermediate_size"], bool(config.get("norm_topk_prob")),
                           True, config.get("shared_expert_intermediate_size") or 0)
    # Mixtral: renormalised, weights kept in float32
    return MoESettings(experts, config["num_experts_per_tok"], config["intermediate_size"], True,
                       False)


def dense_layers(config: dict, kind: MoeKind | None) -> list[int]:
    """Layers of a MoE config that keep a dense MLP (Qwen2/3-MoE's mlp_only_layers and
    decoder_sparse_step); the native modules serve only configs where this is empty."""
    if moe_settings(config, kind) is None:
        return []
    step = config.get("decoder_sparse_step") or 1
    only = set(config.get("mlp_only_layers") or [])
    return [i for i in range(config["num_hidden_layers"]) if i in only or (i + 1) % step]


def parse_expert_name(name: str) -> tuple[int, str] | None:
    """(expert, "gate" | "up" | "down") of a checkpoint expert weight, else None."""
    match = _EXPERT.search(name)
    return (int(match.group(1)), _PROJECTIONS[match.group(2)]) if match else None


def is_router_name(name: str) -> bool:
    return bool(_ROUTER.search(name))


class SparseMoE(nn.Module):
    """x [N, hidden] → [N, hidden]: this rank's share of the experts' weighted sum."""

    def __init__(self, hidden: int, inter: int, settings: MoESettings,
                 shared_inter: int = 0) -> None:
        """`inter`, `shared_inter`: this rank's share of each expert's intermediate rows and of
        the shared expert's."""
        super().__init__()
        num_experts = settings.num_experts
        self.num_experts, self.top_k, self.inter = num_experts, settings.top_k, inter
        self.renormalise, self.cast_weights = settings.renormalise, settings.cast_weights
        self.dense_decode = False  # LlamaForCausalLM.use_dense_moe_decode sets it
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(num_experts * 2 * inter, hidden))  # gate; up rows
        self.w2 = nn.Parameter(torch.empty(num_experts * hidden, inter))  # down
        # nn.Linear, or a packed layer that replaced it (engine/models/linear.py)
        self.shared_gate_up: nn.Module | None = None
        self.shared_down: nn.Module | None = None
        self.shared_gate: nn.Module | None = None
        if settings.shared_inter:
            self.shared_gate_up = nn.Linear(hidden, 2 * shared_inter, bias=False)
            self.shared_down = nn.Linear(shared_inter, hidden, bias=False)
            self.shared_gate = nn.Linear(hidden, 1, bias=False)  # every rank: the same scale

    def forward(self, x: torch.Tensor, decode_only: bool = False) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [N, k] each
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast_weights:
            weights = weights.to(x.dtype)
        w13 = self.w13.view(self.num_experts, 2 * self.inter, -1)  # [E, 2I, hidden]
        w2 = self.w2.view(self.num_experts, -1, self.inter)  # [E, hidden, I]
        if decode_only and self.dense_decode:
            out = self._dense(x, weights, chosen, w13, w2)
        else:
            out = self._sparse(x, weights, chosen, w13, w2)
        if self.shared_gate is not None:  # added after the routed experts, as transformers does
            assert self.shared_gate_up is not None and self.shared_down is not None  # set together
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared_down(F.silu(gate) * up)
        return out

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
               w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, mixed by the router's weights; no host read."""
        mix = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype,
                          device=x.device).scatter_(1, chosen, weights)  # [N, E]
        gate, up = torch.matmul(x, w13.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
        y = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2))  # [E, N, hidden]
        return torch.einsum("ne,enh->nh", mix.to(y.dtype), y).to(x.dtype)

    def _sparse(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Each expert the batch uses on its own tokens (reads the router's choice)."""
        # [E, k, N]: which (choice, token) pairs each expert serves
        served = F.one_hot(chosen, self.num_experts).permute(2, 1, 0)
        out = torch.zeros_like(x)
        # NOTE: experts in ascending order, each adding into `out`, as transformers sums them
        for expert in served.sum(dim=(1, 2)).nonzero().flatten().tolist():
            rank, token = torch.where(served[expert])
            gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[expert]) * weights[token, rank, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out
