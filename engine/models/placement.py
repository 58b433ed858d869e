"""Where each checkpoint tensor lands in the native Llama-family modules, on each tensor-parallel
rank: q/k/v and gate/up fused by rows, o/down split by columns, the vocabulary by rows, experts
stacked. Pure index arithmetic over the model's specs and shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.models.moe import is_router_name, parse_expert_name
from engine.parallel.shard import rows_of_heads

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint tensor lands: our parameter, the first row written, and the part of
    the tensor this rank reads (None: this rank keeps its zeros, e.g. a row-parallel bias
    that rank 0 alone adds)."""

    target: str
    offset: int
    index: tuple[slice, ...] | None


def llama_placements(model: LlamaForCausalLM, name: str) -> list[Placement]:
    """Where the checkpoint tensor `name` lands on this rank: q/k/v and gate/up are fused
    into one matmul each and split by rows, o/down split by columns, the vocabulary by
    rows. A checkpoint that stores them fused (a record with fused_checkpoint: Phi-3) lands
    in parts, each sliced for this rank. []: a tensor this model does not keep (a tied
    lm_head)."""
    name = name.removeprefix("model.")
    if model.tie_word_embeddings and name == "lm_head.weight":
        return []
    full, local, shard = model.full_spec, model.spec, model.shard
    d, everything = full.head_dim, (slice(None),)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return [Placement(name, 0, (slice(model.vocab.start, model.vocab.stop),))]
    q_rows = rows_of_heads(shard.split(full.num_heads), d)
    kv_rows = rows_of_heads(shard.kv_heads(full.num_heads, full.num_kv_heads), d)
    inter = model.inter
    inter_span = shard.split(inter)
    inter_rows = slice(inter_span.start, inter_span.stop)
    q, kv = local.num_heads * d, local.num_kv_heads * d
    full_q, full_kv = full.num_heads * d, full.num_kv_heads * d
    # checkpoint tensor -> (ours, [(first row we write, rows of it we read)])
    parts = {"self_attn.q_proj": ("qkv_proj", [(0, q_rows)]),
             "self_attn.k_proj": ("qkv_proj", [(q, kv_rows)]),
             "self_attn.v_proj": ("qkv_proj", [(q + kv, kv_rows)]),
             "mlp.gate_proj": ("gate_up_proj", [(0, inter_rows)]),
             "mlp.up_proj": ("gate_up_proj", [(len(inter_span), inter_rows)])}
    if model.record.fused_checkpoint:
        parts["self_attn.qkv_proj"] = ("qkv_proj", [
            (0, q_rows), (q, _after(full_q, kv_rows)),
            (q + kv, _after(full_q + full_kv, kv_rows))])
        parts["mlp.gate_up_proj"] = ("gate_up_proj", [
            (0, inter_rows), (len(inter_span), _after(inter, inter_rows))])
    expert = parse_expert_name(name)
    if expert is not None:
        return _expert_placements(model, name, *expert, inter_rows, len(inter_span))
    if is_router_name(name):  # every rank routes every token
        return [Placement(f"layers.{name.split('.')[1]}.moe.gate.weight", 0, everything)]
    if ".mlp.shared_expert" in name:
        return _shared_expert_placements(model, name)
    for hf, (ours, pieces) in parts.items():
        if f".{hf}." in name:
            target = name.replace(hf, ours)
            return [Placement(target, offset, (rows,)) for offset, rows in pieces]
    for hf, ours, columns in (("self_attn.o_proj", "o_proj", q_rows),
                              ("mlp.down_proj", "down_proj", inter_rows)):
        if f".{hf}." in name:  # row-parallel: the bias is added once, by rank 0
            target = name.replace(hf, ours)
            if name.endswith(".bias"):
                return [Placement(target, 0, everything if shard.rank == 0 else None)]
            return [Placement(target, 0, (slice(None), columns))]
    if ".self_attn.q_norm." in name or ".self_attn.k_norm." in name:  # every rank
        return [Placement(name.replace(".self_attn.", "."), 0, everything)]
    return [Placement(name, 0, everything)]


def _expert_placements(model: LlamaForCausalLM, name: str, expert: int, kind: str, rows: slice,
                       local_inter: int) -> list[Placement]:
    """An expert's gate/up rows land in the layer's stacked w13 (gate then up, per expert),
    its down projection's columns for this rank in w2."""
    layer = f"layers.{name.split('.')[1]}.moe"
    if kind == "down":
        hidden = model.full_spec.hidden_size
        return [Placement(f"{layer}.w2", expert * hidden, (slice(None), rows))]
    offset = expert * 2 * local_inter + (local_inter if kind == "up" else 0)
    return [Placement(f"{layer}.w13", offset, (rows,))]


def _shared_expert_placements(model: LlamaForCausalLM, name: str) -> list[Placement]:
    """Qwen2-MoE's shared expert: split like a dense MLP; its sigmoid gate on every rank."""
    layer = f"layers.{name.split('.')[1]}.moe"
    if ".mlp.shared_expert_gate." in name:
        return [Placement(f"{layer}.shared_gate.weight", 0, (slice(None),))]
    span = model.shard.split(model.config["shared_expert_intermediate_size"])
    rows = slice(span.start, span.stop)
    if ".down_proj." in name:
        return [Placement(f"{layer}.shared_down.weight", 0, (slice(None), rows))]
    offset = len(span) if ".up_proj." in name else 0
    return [Placement(f"{layer}.shared_gate_up.weight", offset, (rows,))]


def _after(start: int, rows: slice) -> slice:
    """`rows` of a part that begins at row `start` of a fused tensor."""
    return slice(start + rows.start, start + rows.stop)
