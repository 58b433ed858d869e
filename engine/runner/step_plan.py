"""StepPlan: one step as the host decides it (token ids, positions, KV slots, page tables, which
rows are sampled), in plain integers before any tensor exists. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler.base import ScheduledBatch
from engine.sequence import PENDING_TOKEN, Sequence


@dataclass(frozen=True)
class StepPlan:
    """One step as the host decided it, before any tensor exists; plain lists, so it pickles
    to tensor-parallel worker ranks. A sequence has one block table per KV table of the layout
    (engine/kv/layout.py): each token has a slot in each."""

    num_seqs: int
    ids: list[int]  # [N] packed token ids of every scheduled token
    positions: list[int]  # [N]
    slots: list[list[int]]  # [tables, N] KV slot each token writes, in each block table
    decodes: list[tuple[int, list[list[int]], int]]  # (packed row, block tables, context)
    prefills: list[tuple[int, int, list[list[int]], int]]  # (row, tokens, tables, context)
    sample_rows: list[int]  # packed rows whose logits are sampled
    # which of the batch's sequences they belong to: a sequence with k proposals has k + 1
    # rows (its last token's and each proposal's), in order
    sampled: list[int]
    # (packed token, row of the previous step's samples): inputs still on the device
    carried: tuple[tuple[int, int], ...] = ()
    # LoRA (engine/lora/runtime.py): each packed token's adapter slot (-1: none; empty: no
    # LoRA), and the (slot, adapter key, folder) loads every rank makes before the step
    lora_rows: tuple[int, ...] = ()
    lora_loads: tuple[tuple[int, str, str], ...] = ()


def pack_step(batch: ScheduledBatch, block_size: int, last_sampled: dict[int, int],
              long_rope_rows: int = 0, num_tables: int = 1) -> StepPlan:
    """The step's integers: token ids, positions, KV slots, and which rows attend to which pages
    and get sampled. `last_sampled` (seq id -> row) says where the previous launch sampled each
    sequence: a pending input is read from there on the device. The positions of a sequence
    in LongRoPE's long mode are shifted by `long_rope_rows`: they index the long RoPE rows."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in range(num_tables)]
    decodes: list[tuple[int, list[list[int]], int]] = []  # (packed row, block tables, context)
    prefills: list[tuple[int, int, list[list[int]], int]] = []  # (row, tokens, tables, context)
    sample_rows: list[int] = []
    sampled: list[int] = []
    carried: list[tuple[int, int]] = []  # (packed token, previous step's sample row)
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_scheduled_tokens, strict=True)):
        start, tables, row = seq.num_computed_tokens, seq.block_tables, len(ids)
        assert len(tables) == num_tables, f"{seq} has {len(tables)} block tables, not {num_tables}"
        end = start + n
        if seq.token_ids[end - 1] == PENDING_TOKEN:
            carried.append((row + n - 1, _carried_row(seq, last_sampled)))
        if n == 1:
            ids.append(seq.token_ids[start])
            positions.append(start + long_rope_rows * seq.long_rope)
            for table, table_slots in zip(tables, slots, strict=True):
                table_slots.append(table[start // bs] * bs + start % bs)
            decodes.append((row, tables, end))
        else:
            ids += seq.token_ids[start:end]
            shift = long_rope_rows * seq.long_rope
            positions += range(start + shift, end + shift)
            for table, table_slots in zip(tables, slots, strict=True):
                table_slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            prefills.append((row, n, tables, end))
        if end == seq.num_tokens:  # caught up: its next token is sampled (after each proposal)
            k = min(seq.num_drafts, n - 1)
            sample_rows += range(row + n - 1 - k, row + n)
            sampled += [i] * (k + 1)
    return StepPlan(len(batch.seqs), ids, positions, slots, decodes, prefills, sample_rows,
                    sampled, tuple(carried))


def token_rows(plan: StepPlan) -> list[tuple[int, list[list[int]], int]]:
    """Every packed token as a decode row (packed row, block tables, context), in packed order:
    a prompt chunk's token at position p is a row with context p + 1. What the padded step
    runs: a chunk's rows see each other because every row's K/V is written before any reads."""
    if not plan.prefills:
        return plan.decodes
    rows = list(plan.decodes)
    for row, n, tables, ctx in plan.prefills:
        rows += [(row + j, tables, ctx - n + j + 1) for j in range(n)]
    rows.sort(key=lambda r: r[0])
    return rows


def _carried_row(seq: Sequence, last_sampled: dict[int, int]) -> int:
    """Where the previous launch sampled `seq`'s pending input (only that one can be pending)."""
    if seq.num_pending != 1 or seq.seq_id not in last_sampled:
        raise RuntimeError(f"{seq}: its input token is pending but not from the last step")
    return last_sampled[seq.seq_id]
