"""One Triton kernel for every step's attention, reading K and V in place through page tables.

Import only after engine.kernels.triton_setup.import_triton(device): Triton fixes at import
whether it compiles (CUDA) or interprets (CPU) the kernels below.

A program attends one block of a sequence's queries (BLOCK_Q consecutive query tokens x the
query heads of one KV head: GQA rows share each K/V tile they load) over the keys they can see,
tile by tile (BLOCK_N keys, gathered page by page through the sequence's page table), with an
online softmax. Decode rows are sequences of one query, prompt chunks sequences of many (causal
among themselves, after any prefix); a sliding window bounds both ends of the key range, so
pages a sequence slid past are never read. With split_kv > 1 (few sequences, long contexts:
flash-decoding) each program covers one slice of its key range and the slices are merged after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, stat_ptr,
    pages_ptr, q_start_ptr, q_len_ptr, ctx_ptr, cu_blocks_ptr,
    num_seqs, num_tokens, scale, softcap, window,
    stride_qt, stride_qh, stride_pages,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    LOG_SEQS: tl.constexpr, IEEE: tl.constexpr, CAPPED: tl.constexpr,
):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if block >= tl.load(cu_blocks_ptr + num_seqs):
        return  # the grid is a bound on the blocks (graph replays keep one grid)
    # the sequence whose query blocks hold `block`: the last with cu_blocks[s] <= block
    # (scalar tensors from the start: Triton treats an argument equal to 1 as a constant)
    lo_seq = block * 0
    hi_seq = block * 0 + num_seqs
    for _ in range(LOG_SEQS):
        mid = (lo_seq + hi_seq) // 2
        go_right = tl.load(cu_blocks_ptr + mid) <= block
        lo_seq = tl.where(go_right, mid, lo_seq)
        hi_seq = tl.where(go_right, hi_seq, mid)
    seq = lo_seq
    q_len = tl.load(q_len_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    first_query = (block - tl.load(cu_blocks_ptr + seq)) * BLOCK_Q

    # rows: query i of the block x head g of the KV head's group, [M] with M = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    query = first_query + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (query < q_len) & (rows % GROUP_P < GROUP)
    q_pos = ctx - q_len + query  # [M] each row's position; it sees keys up to it
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    token = tl.load(q_start_ptr + seq) + query
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [M, D]

    # the keys any row of the block sees: [key_lo, key_hi)
    key_hi = tl.minimum(ctx, ctx - q_len + first_query + BLOCK_Q)
    key_lo = tl.where(window > 0, tl.maximum(ctx - q_len + first_query - window + 1, 0), 0)
    tiles = tl.cdiv(key_hi - key_lo, BLOCK_N)
    per_split = tl.cdiv(tiles, SPLITS)
    start = key_lo + split * per_split * BLOCK_N
    stop = tl.minimum(key_hi, start + per_split * BLOCK_N)

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
    kv_stride = NUM_HEADS // GROUP * HEAD_DIM  # a slot's K (or V) for every KV head
    for tile in range(start, stop, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)  # [N] positions
        key_ok = keys < stop
        page = tl.load(pages_ptr + seq * stride_pages + keys // PAGE, mask=key_ok, other=0)
        slot = page.to(tl.int64) * PAGE + keys % PAGE
        k_off = slot[None, :] * kv_stride + kv_head * HEAD_DIM + dims[:, None]  # [D, N]
        k = tl.load(k_ptr + k_off, mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale  # [M, N]
        if CAPPED:  # tanh(s / cap) * cap, tanh from exp (present in every Triton)
            e = tl.exp(-2.0 * tl.abs(s) / softcap)
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(s < 0, -t, t) * softcap
        seen = key_ok[None, :] & (keys[None, :] <= q_pos[:, None]) & (
            (window <= 0) | (keys[None, :] > q_pos[:, None] - window))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows seeing nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = slot[:, None] * kv_stride + kv_head * HEAD_DIM + dims[None, :]  # [N, D]
        v = tl.load(v_ptr + v_off, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_off = token[:, None] * NUM_HEADS * HEAD_DIM + head[:, None] * HEAD_DIM + dims[None, :]
    if SPLITS == 1:
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + out_off, result.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
    else:  # unnormalised, with the slice's max and sum, merged by merge_splits
        part = split * num_tokens * NUM_HEADS * HEAD_DIM
        tl.store(part_ptr + part + out_off, acc, mask=row_ok[:, None] & dim_ok[None, :])
        stat = (split * num_tokens * NUM_HEADS + token * NUM_HEADS + head) * 2
        tl.store(stat_ptr + stat, m_i, mask=row_ok)
        tl.store(stat_ptr + stat + 1, l_i, mask=row_ok)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, pages: torch.Tensor, q_start: torch.Tensor,
                    q_len: torch.Tensor, ctx: torch.Tensor, cu_blocks: torch.Tensor,
                    num_blocks: int, page_size: int, scale: float, window: int | None,
                    softcap: float | None, block_q: int, block_n: int, split_kv: int) -> None:
    """Fills `out` [N, H, D] with attention of q [N, H, D] (rows named by the sequences) over
    the pool k_cache / v_cache [slots, Hkv, D]. Per sequence s: its queries are the q rows
    q_start[s] .. q_start[s] + q_len[s] - 1, at the last q_len[s] of its ctx[s] positions; its
    keys are at pages[s] (page p holds positions p * page_size ...); cu_blocks [S + 1] counts
    query blocks of block_q tokens; `num_blocks` bounds cu_blocks[S] (the grid's size)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, kv_heads = q_len.numel(), k_cache.shape[1]
    assert q.stride(2) == 1 and out.is_contiguous() and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and pages.stride(1) == 1
    group = num_heads // kv_heads
    group_p = triton.next_power_of_2(group)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    part = stat = out  # unused unless split: any tensor of the right device
    if split_kv > 1:
        # [splits, N, H, D] float32 accumulators and [splits, N, H, 2] (max, sum)
        part = torch.zeros(split_kv, num_tokens, num_heads, head_dim, device=q.device)
        stat = torch.full((split_kv, num_tokens, num_heads, 2), float("-inf"),
                          device=q.device)
    grid = (num_blocks, kv_heads, split_kv)
    _paged_attention[grid](
        q, k_cache, v_cache, out, part, stat, pages, q_start, q_len, ctx, cu_blocks,
        num_seqs, num_tokens, scale, softcap or 0.0, window or 0,
        q.stride(0), q.stride(1), pages.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, PAGE=page_size, BLOCK_Q=block_q, BLOCK_N=block_n,
        SPLITS=split_kv, LOG_SEQS=max(1, num_seqs.bit_length()),
        IEEE=q.dtype == torch.float32, CAPPED=softcap is not None)
    if split_kv > 1:
        merge_splits(part, stat, out, q_start, q_len)


def merge_splits(part: torch.Tensor, stat: torch.Tensor, out: torch.Tensor,
                 q_start: torch.Tensor, q_len: torch.Tensor) -> None:
    """The slices' partial softmax results → out, for the rows the sequences hold (rows no
    sequence names keep their values)."""
    m, lsum = stat[..., 0], stat[..., 1]  # [splits, N, H]
    top = m.amax(0)  # [N, H]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp(m - top) * lsum.clamp(min=0)  # slices that saw nothing weigh 0
    total = weight.sum(0).clamp(min=1e-30)  # [N, H]
    acc = (part * torch.exp(m - top)[..., None]).sum(0)  # [N, H, D]
    merged = (acc / total[..., None]).to(out.dtype)
    rows = _named_rows(q_start, q_len, out.shape[0])  # [N] bool
    out.copy_(torch.where(rows[:, None, None], merged, out))


def _named_rows(q_start: torch.Tensor, q_len: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N] bool: the q rows some sequence names (no host sync: a graph may capture it)."""
    idx = torch.arange(num_tokens, device=q_start.device)  # [N]
    inside = (idx[None, :] >= q_start[:, None]) & (idx[None, :] < (q_start + q_len)[:, None])
    return inside.any(0)
