"""A rank's LoRA state: the wrapped layers' slots and the step's rows, staged by the runner.

Rank 0 decides each step's slots (plan_rows) and writes them into its StepPlan, so that worker
ranks of a tensor-parallel model load the same adapters into the same slots (each reads its
own shard from the adapter's folder) before they run the same step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.kernels import load_kernels
from engine.lora.manager import SlotTable
from engine.lora.peft_files import LoraAdapter, read_adapter
from engine.lora.weights import LoraContext, check_fits, load_slot, wrap_model

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

NO_ADAPTER = -1  # a row's slot when it runs the base model alone
# An adapter with this many rows in a step (a prompt chunk) updates them with two PyTorch
# matmuls; fewer rows go through the C kernel, where PyTorch's per-call cost would dominate.
MANY_ROWS = 16
READ_CACHE = 4  # adapters a worker rank keeps read (rank 0's registry keeps its own LRU)

# (slot, adapter key, its folder): what a step loads before it runs
SlotLoad = tuple[int, str, str]


class LoraRuntime:
    """The model's LoRA-wrapped layers, their slots, and which rows use which slot."""

    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype, max_rows: int) -> None:
        self.model = model
        self.max_rank = max_rank
        self.device = device
        self.context = LoraContext(
            row_slots=torch.full((max_rows,), NO_ADAPTER, dtype=torch.int64, device=device),
            slot_ids=torch.arange(num_slots, device=device))
        self.row_slots = self.context.row_slots  # [max_rows]: fixed address, for graphs
        self.targets = wrap_model(model, num_slots, max_rank, self.context, device, dtype)
        if device.type != "cpu":  # masked from the start: CUDA graphs capture the updates
            self.context.groups = None
        elif dtype == torch.float32:
            self.context.kernel = _cpu_kernel()
        self.slots = SlotTable(num_slots)
        self.read: OrderedDict[str, LoraAdapter] = OrderedDict()  # worker ranks: key -> read

    @property
    def num_slots(self) -> int:
        return len(self.slots.held)

    def check(self, adapter: LoraAdapter) -> None:
        """AdapterError unless `adapter` fits this model's layers."""
        check_fits(self.model, self.targets, adapter)

    def plan_rows(self, keys: Sequence[str | None], counts: Sequence[int],
                  path_of: Callable[[str], str]) -> tuple[list[int], list[SlotLoad]]:
        """Rank 0: each token row's slot (sequences' adapter `keys`, `counts` rows each) and
        the slot loads the step needs first."""
        slots, loads = self.slots.assign(key for key in keys if key is not None)
        rows: list[int] = []
        for key, count in zip(keys, counts, strict=True):
            rows += [NO_ADAPTER if key is None else slots[key]] * count
        return rows, [(slot, key, path_of(key)) for slot, key in loads]

    def stage(self, rows: list[int], loads: Sequence[SlotLoad],
              read: Callable[[str], LoraAdapter] | None, padded: bool,
              uploaded: torch.Tensor | None = None) -> None:
        """Load the step's new slots, then tell the layers which rows use which slot: grouped
        by adapter for an eager CPU step, as a masked row table otherwise (fixed shapes).
        `read`: rank 0's registry (by key); worker ranks read the folders themselves.
        `uploaded`: `rows` on the device, from the step's one upload (the masked table)."""
        for slot, key, path in loads:
            try:
                adapter = read(key) if read is not None else self._read(key, path)
                load_slot(self.model, self.targets, slot, adapter, self.max_rank)
            except BaseException:  # the slot holds nothing it can be trusted for
                self.slots.forget(slot)
                raise
        context = self.context
        if self.device.type == "cpu" and not padded:
            context.groups, context.few_rows = _groups(rows, self.context.kernel is not None)
            context.few_slots = () if context.few_rows is None else tuple(
                {slot for slot in rows if slot != NO_ADAPTER} - {g for g, _ in context.groups})
            return
        context.groups = None
        # the static table (captured graphs read it), or for an eager step longer than any
        # graph's, a table of its own
        context.row_slots = self.row_slots if len(rows) <= self.row_slots.numel() else \
            torch.empty(len(rows), dtype=torch.int64, device=self.device)
        if rows:
            assert uploaded is not None, "the runner uploads the rows with the step"
            context.row_slots[:len(rows)].copy_(uploaded)
        context.row_slots[len(rows):].fill_(NO_ADAPTER)  # padding rows of a padded step

    def _read(self, key: str, path: str) -> LoraAdapter:
        """A worker rank's adapter, read from its folder (a few kept)."""
        if key not in self.read:
            self.read[key] = read_adapter(key.rsplit("@", 1)[0], path, self.max_rank)
            while len(self.read) > READ_CACHE:
                self.read.popitem(last=False)
        return self.read[key]


def _groups(rows: list[int], kernel: bool
            ) -> tuple[list[tuple[int, torch.Tensor | None]], torch.Tensor | None]:
    """(slot, its rows) of each adapter with many rows in the step (None: every row), and,
    with the C kernel, the slots of the rows of the others ([N], -1 elsewhere; None: none)."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(rows):
        if slot != NO_ADAPTER:
            by_slot.setdefault(slot, []).append(row)
    few = [slot for slot, members in by_slot.items() if kernel and len(members) < MANY_ROWS]
    groups = [(slot, None if len(members) == len(rows) else torch.tensor(members))
              for slot, members in by_slot.items() if slot not in few]
    if not few:
        return groups, None
    kept = set(few)
    return groups, torch.tensor([slot if slot in kept else NO_ADAPTER for slot in rows])


def _cpu_kernel() -> object | None:
    """engine/kernels/lora.c where a C compiler is there (else PyTorch's matmuls only)."""
    try:
        return load_kernels()
    except RuntimeError as err:
        logger.warning("LoRA: no C kernel (%s); updates run as PyTorch matmuls", err)
        return None
