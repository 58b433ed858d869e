"""A step's attention metadata, built on the device from what the runner uploaded: one
AttentionMetadata per attention group (a window and a block table, engine/kv/layout.py), each
window's masks built once and shared by its groups. Called by the runner only."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.attention.reference import (
    AttentionBackend,
    AttentionMetadata,
    PrefillRow,
    causal_mask,
    visible_positions,
)
from engine.kv.layout import KVLayout


@dataclass(frozen=True)
class StepViews:
    """The uploaded step (device views by section name) and the plan rows they came from."""

    views: dict[str, torch.Tensor]
    decodes: list  # StepPlan.decodes: (packed row, block tables, context)
    prefills: list  # StepPlan.prefills: (row, tokens, block tables, context)
    page_spans: list[tuple[int, int]]  # each prefill row's pages in "prefill_pages"


def describe_step(step: StepViews, layout: KVLayout, backend: AttentionBackend,
                  page_size: int, staged_window: int | None) -> AttentionMetadata:
    """The metadata of the step's first attention group, holding every group's where there
    are several; `staged_window`: the window the uploaded first visible positions are for."""
    masks: dict[int | None, tuple[list, dict]] = {}
    groups = []
    for window, table in zip(layout.group_windows, layout.group_tables, strict=True):
        if window not in masks:
            masks[window] = _window_masks(step, window, page_size, staged_window, backend)
        groups.append(_describe_group(step, table, window, masks[window], backend, page_size))
    if len(groups) == 1:
        return groups[0]
    return replace(groups[0], groups=tuple(groups), layer_groups=layout.layer_groups)


def _describe_group(step: StepViews, table: int, window: int | None,
                    masks: tuple[list, dict], backend: AttentionBackend,
                    page_size: int) -> AttentionMetadata:
    """The step for layers reading block table `table` within `window`."""
    prefill_masks, decode = masks
    views = step.views
    rows = tuple(
        PrefillRow(row, n, ctx, views["prefill_pages"][table][a:b], mask)
        for (row, n, _, ctx), (a, b), mask in zip(step.prefills, step.page_spans, prefill_masks,
                                                  strict=True))
    if step.decodes:
        decode = {**decode, "decode_pages": views["decode_pages"][table]}  # [B, max_pages]
    meta = AttentionMetadata(
        slot_mapping=views["tokens"][2 + table], page_size=page_size, prefills=rows,
        backend=backend, window=window, **decode)
    return replace(meta, backend_state=backend.prepare(meta))


def first_visible(ctx: torch.Tensor, staged_lo: torch.Tensor, window: int | None,
                  staged_window: int | None) -> torch.Tensor:
    """[B] first position decode rows of contexts `ctx` see within `window` (`staged_lo` holds
    it for `staged_window`, as the runner uploaded it)."""
    if window == staged_window:
        return staged_lo
    return torch.zeros_like(ctx) if window is None else (ctx - window).clamp(min=0)


def _window_masks(step: StepViews, window: int | None, page_size: int,
                  staged_window: int | None, backend: AttentionBackend) -> tuple[list, dict]:
    """What layers attending within `window` may see: each prefill row's mask (where the
    backend reads it), and the decode rows' visible positions (their pages are each block
    table's; as a mask too where the backend reads it, else only as bounds)."""
    views = step.views
    device = views["tokens"].device
    prefill_masks = [causal_mask(n, ctx, window, device) if backend.reads_prefill_mask
                     else None for _, n, _, ctx in step.prefills]
    decode: dict = {"decode_token_idx": None, "decode_pages": None, "decode_mask": None}
    if step.decodes:
        width = views["decode_pages"].shape[2]
        token_idx, ctx, staged_lo, order = views["decode"]  # [B] each
        lo = first_visible(ctx, staged_lo, window, staged_window)
        visible = None
        if backend.reads_decode_mask:
            visible = visible_positions(torch.arange(width * page_size, device=device), ctx, lo)
        decode = {"decode_token_idx": token_idx, "decode_mask": visible,
                  "decode_context_lens": tuple(c for _, _, c in step.decodes),
                  "decode_ctx": ctx, "decode_lo": lo, "decode_order": order}
    return prefill_masks, decode
