"""LoRA slots on the device: each wrapped base layer holds every slot's A and B, so that the
base matmul runs once for the whole batch and each row adds its own adapter's low-rank update.

A wrapped layer (our fused qkv_proj, o_proj, gate_up_proj or down_proj) has one part per
checkpoint module that lands in it (q, k and v in qkv_proj), each `max_rank` columns wide: R =
parts × max_rank columns per slot. Slot l's A lives in rows l·R … of `a` [L·R, in] and its Bᵀ in
rows l·R … of `b` [L·R, out], so an update is t = x aᵀ (shrink, [n, R]) then t·b (expand); a
part's B rows fill only its own output rows (q's, k's, …), zeros elsewhere. Ranks below
max_rank are zero-padded. Where each matrix lands (and which part of it a tensor-parallel rank
keeps) follows the base weight's placement (engine/models/placement.py): B by output rows for
q/k/v/gate/up, A by input columns for o/down (whose outputs the ranks sum).

Two ways to apply a step's updates (LoraContext): grouped, for eager steps on the CPU (each
adapter's rows gathered, two small matmuls each); masked, where shapes must stay fixed (CUDA
graphs; every CUDA step): every slot's shrink for every row, masked to the row's slot, then one
expand. Slots never move, so captured graphs stay valid when adapters change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from engine.lora.errors import AdapterError
from engine.lora.peft_files import LoraAdapter
from engine.models.placement import llama_placements

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

# our fused layer -> the checkpoint modules (under each layer) that land in it
LAYER_PARTS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
FUSED_PARTS = {"qkv_proj": ("self_attn.qkv_proj",), "gate_up_proj": ("mlp.gate_up_proj",)}
ROW_PARALLEL = ("o_proj", "down_proj")  # their input columns are split over ranks


@dataclass
class LoraTarget:
    """One wrapped base layer's slots."""

    name: str  # ours, e.g. "layers.3.qkv_proj"
    # the checkpoint modules landing in it, e.g. "model.layers.3.self_attn.q_proj"
    parts: tuple[str, ...]
    a: torch.Tensor  # [L * R, in]
    b: torch.Tensor  # [L * R, out]
    scale: torch.Tensor  # [L, R]: each column's α / r (zero where unused)
    # per slot: whether its adapter updates this layer at all (grouped mode skips it if not)
    used: list[bool] = field(default_factory=list)

    @property
    def width(self) -> int:  # R
        return self.scale.shape[1]


@dataclass
class LoraContext:
    """Which rows of the step use which slot, shared by every wrapped layer."""

    row_slots: torch.Tensor  # [max rows] int64: each token row's slot, -1 for the base model
    slot_ids: torch.Tensor  # [L] int64: 0 … L - 1
    # grouped mode (eager CPU steps): (slot, its rows [n] or None for all rows); None: masked
    groups: list[tuple[int, torch.Tensor | None]] | None = field(default_factory=list)
    # grouped mode, rows whose adapter has few rows this step: their slots [n] (-1 for the
    # others), for the C kernel (engine/kernels/lora.c) given here; None: none
    few_rows: torch.Tensor | None = None
    few_slots: tuple[int, ...] = ()  # the slots of those rows
    kernel: object | None = None

    def apply(self, target: LoraTarget, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [n, out] (the base layer's output for x [n, in]) plus each row's update."""
        if self.groups is None:
            return y + self._masked(target, x)
        if self.few_rows is not None and any(target.used[s] for s in self.few_slots):
            # in place: y is the base layer's fresh output
            x, y = x.contiguous(), y.contiguous()
            self.kernel.batchyard_lora(  # type: ignore[attr-defined]
                x.data_ptr(), self.few_rows.data_ptr(), target.a.data_ptr(),
                target.b.data_ptr(), target.scale.data_ptr(), y.data_ptr(), x.shape[0],
                x.shape[1], y.shape[1], target.width, torch.get_num_threads())
        width = target.width
        for slot, rows in self.groups:
            if not target.used[slot]:
                continue
            cols = slice(slot * width, (slot + 1) * width)
            xs = x if rows is None else x.index_select(0, rows)  # [m, in]
            t = (xs @ target.a[cols].T) * target.scale[slot]  # [m, R]
            if rows is None:
                y = torch.addmm(y, t, target.b[cols])
            else:
                y = y.index_add(0, rows, t @ target.b[cols])
        return y

    def _masked(self, target: LoraTarget, x: torch.Tensor) -> torch.Tensor:
        n, width = x.shape[0], target.width
        mine = (self.row_slots[:n, None] == self.slot_ids[None, :]).to(x.dtype)  # [n, L]
        t = (x @ target.a.T).view(n, -1, width)  # [n, L, R]
        t = t * (mine[:, :, None] * target.scale[None].to(x.dtype))
        return t.view(n, -1) @ target.b  # [n, out]


class LoraLinear(nn.Module):
    """A base layer (any linear: nn.Linear, packed, int8) plus its rows' LoRA updates."""

    def __init__(self, base: nn.Module, target: LoraTarget, context: LoraContext) -> None:
        super().__init__()
        self.base = base
        self.target = target
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.context.apply(self.target, x, self.base(x))


def wrap_model(model: LlamaForCausalLM, num_slots: int, max_rank: int, context: LoraContext,
               device: torch.device, dtype: torch.dtype) -> list[LoraTarget]:
    """Wrap every layer's qkv/o/gate-up/down in a LoraLinear with `num_slots` empty slots
    (in the model's `dtype`, on its `device`)."""
    targets = []
    fused = model.record.fused_checkpoint
    for i, layer in enumerate(model.layers):
        for ours, parts in LAYER_PARTS.items():
            base = getattr(layer, ours, None)
            if base is None:  # an expert layer's MLP: no LoRA there
                continue
            names = parts + (FUSED_PARTS.get(ours, ()) if fused else ())
            in_features, out_features = _features(base)
            width = len(names) * max_rank
            target = LoraTarget(
                f"layers.{i}.{ours}", tuple(f"model.layers.{i}.{p}" for p in names),
                torch.zeros(num_slots * width, in_features, device=device, dtype=dtype),
                torch.zeros(num_slots * width, out_features, device=device, dtype=dtype),
                torch.zeros(num_slots, width, device=device, dtype=dtype), [False] * num_slots)
            setattr(layer, ours, LoraLinear(base, target, context))
            targets.append(target)
    return targets


def _features(base: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear layer of any kind batchyard builds (each names its features)."""
    features = base.in_features, base.out_features  # nn.Linear's, or a packed layer's ints
    return int(cast(int, features[0])), int(cast(int, features[1]))


def load_slot(model: LlamaForCausalLM, targets: list[LoraTarget], slot: int,
              adapter: LoraAdapter | None, max_rank: int) -> None:
    """Write `adapter` (None: nothing) into `slot` of every target. Raises AdapterError, before
    writing anything, when a matrix does not fit this model."""
    if adapter is not None:
        check_fits(model, targets, adapter)
    staged = [(t, _slot_weights(model, t, adapter, max_rank)) for t in targets]
    for target, (a, b, scale) in staged:
        width = target.width
        rows = slice(slot * width, (slot + 1) * width)
        target.a[rows].copy_(a)
        target.b[rows].copy_(b)
        target.scale[slot].copy_(scale)
        target.used[slot] = adapter is not None and any(p in adapter.modules
                                                        for p in target.parts)


def check_fits(model: LlamaForCausalLM, targets: list[LoraTarget],
               adapter: LoraAdapter) -> None:
    """AdapterError unless every module of `adapter` is a layer of this model, with its
    checkpoint shapes ([r, in] and [out, r])."""
    known = {p for t in targets for p in t.parts}
    for module, update in adapter.modules.items():
        if module not in known:
            raise AdapterError(f"adapter {adapter.name!r}: module {module} is not a layer of "
                               "this model that LoRA applies to")
        out_features, in_features = _checkpoint_shape(model, module.rsplit(".", 1)[-1])
        if update.a.shape[1] != in_features or update.b.shape[0] != out_features:
            raise AdapterError(
                f"adapter {adapter.name!r}: {module} has lora_A {tuple(update.a.shape)} and "
                f"lora_B {tuple(update.b.shape)}; this model needs [r, {in_features}] and "
                f"[{out_features}, r]")


def _checkpoint_shape(model: LlamaForCausalLM, kind: str) -> tuple[int, int]:
    """(out, in) of the checkpoint's (unsharded) `kind` weight."""
    spec, inter = model.full_spec, model.inter
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden = spec.hidden_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "qkv_proj": (q + 2 * kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}[kind]


def _slot_weights(model: LlamaForCausalLM, target: LoraTarget, adapter: LoraAdapter | None,
                  max_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a [R, in], b [R, out], scale [R]) of one slot of `target`, float32 on the host."""
    width = target.width
    a = torch.zeros(width, target.a.shape[1])
    b = torch.zeros(width, target.b.shape[1])
    scale = torch.zeros(width)
    if adapter is None:
        return a, b, scale
    row_parallel = target.name.rsplit(".", 1)[-1] in ROW_PARALLEL
    for j, module in enumerate(target.parts):
        update = adapter.modules.get(module)
        if update is None:
            continue
        rank = update.a.shape[0]
        cols = slice(j * max_rank, j * max_rank + rank)
        for place in llama_placements(model, f"{module}.weight"):
            index = place.index
            if index is None:
                continue
            if row_parallel:  # this rank's input columns of A; all of B
                a[cols] = update.a[index]
                b[cols, place.offset:place.offset + update.b.shape[0]] = update.b.T
            else:  # all of A; this rank's output rows of B, at the part's offset
                part_b = update.b[index[0]]  # [rows, r]
                a[cols] = update.a
                b[cols, place.offset:place.offset + part_b.shape[0]] = part_b.T
        scale[cols] = update.scale
    return a, b, scale
