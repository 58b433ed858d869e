"""A step's page tables as the runner stages them into the step buffer: each decode row's pages
(padded to the widest row) with its context and first visible position, and every prefill row's
pages in one section. Plain integers on the host; the runner uploads them once."""

from __future__ import annotations

from engine.runner.step_buffer import StepBuffer

Decodes = list[tuple[int, list[list[int]], int]]  # (packed row, block tables, context)
Prefills = list[tuple[int, int, list[list[int]], int]]  # (row, tokens, block tables, context)


def pages_of(block_table: list[int], context: int, page_size: int, block_size: int) -> list[int]:
    """Pages holding positions 0..context-1 (a page is page_size consecutive slots)."""
    num_pages = -(-context // page_size)
    per_block = block_size // page_size
    if per_block == 1:
        return block_table[:num_pages]
    return [block_table[j // per_block] * per_block + j % per_block for j in range(num_pages)]


def stage_decodes(buffer: StepBuffer, decodes: Decodes, page_size: int, block_size: int,
                  num_tables: int, window: int | None) -> None:
    """Sections "decode" [4, B] (packed row, context, first visible position, rank by context)
    and "decode_pages" [tables, B, width]."""
    if not decodes:
        return
    contexts = [ctx for _, _, ctx in decodes]
    lows = [0] * len(contexts) if window is None else [max(0, c - window) for c in contexts]
    order = sorted(range(len(contexts)), key=contexts.__getitem__)
    # [4, B]: packed row, context length, first visible position, rank by context
    buffer.put("decode", [[row for row, _, _ in decodes], contexts, lows, order],
               shape=(4, len(decodes)))
    width = -(-max(contexts) // page_size)
    flat: list[int] = []  # [tables, B, width]: each row's pages per table, then page 0s
    for t in range(num_tables):
        for _, tables, ctx in decodes:
            pages = pages_of(tables[t], ctx, page_size, block_size)
            flat += pages
            flat += [0] * (width - len(pages))
    buffer.put("decode_pages", flat, shape=(num_tables, len(decodes), width))


def stage_prefill_pages(buffer: StepBuffer, prefills: Prefills, page_size: int,
                        block_size: int, num_tables: int) -> list[tuple[int, int]]:
    """All prefill rows' pages in one section, "prefill_pages" [tables, pages]; returns each
    row's (start, end) in it."""
    flat: list[list[int]] = [[] for _ in range(num_tables)]
    spans = []
    for _, _, tables, ctx in prefills:
        start = len(flat[0])
        for table, table_pages in zip(tables, flat, strict=True):
            table_pages += pages_of(table, ctx, page_size, block_size)
        spans.append((start, len(flat[0])))
    if prefills:
        buffer.put("prefill_pages", flat, shape=(len(flat), len(flat[0])))
    return spans
