"""Batched sampling with per-sequence parameters; greedy rows take one argmax."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.outputs import SampledToken
from engine.sequence import Sequence

# logits [S, vocab] → (argmax ids, their log-probabilities), or None where it cannot tell
GreedyKernel = Callable[[torch.Tensor], tuple[list[int], list[float]] | None]

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) over the generator's seed space


def sample(logits: torch.Tensor, seqs: list[Sequence],
           greedy: GreedyKernel | None = None) -> list[SampledToken]:
    """logits [S, vocab] float32, one row per sequence → one sampled token per row.

    Processors run in transformers' order: repetition penalty, min-new-tokens EOS mask, then
    temperature, top-k and top-p before drawing, so greedy rows equal `generate` exactly.
    A batch of plain greedy rows (no processor, no top_logprobs) goes to `greedy` when given:
    the same argmax, the log-probability to float rounding.
    """
    if greedy is not None and all(_plain_greedy(seq) for seq in seqs):
        picked = greedy(logits)
        if picked is not None:
            return [SampledToken(token, lp, ()) for token, lp in zip(*picked, strict=True)]
    logprobs = torch.log_softmax(logits, dim=-1)  # [S, vocab] of the raw model distribution
    processed = _apply_penalties(logits, seqs)
    chosen = processed.argmax(dim=-1)  # [S]
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            chosen[i] = _draw(processed[i], seq, int(chosen[i]))
    picked = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    top = _top_logprobs(logprobs, seqs)
    return [SampledToken(token, lp, alternatives)
            for token, lp, alternatives in zip(chosen.tolist(), picked, top, strict=True)]


def _top_logprobs(logprobs: torch.Tensor, seqs: list[Sequence]) -> list[tuple]:
    """The k most likely (token id, log-probability) pairs of each row that asked for them."""
    k = max(seq.params.top_logprobs for seq in seqs)
    if k == 0:
        return [()] * len(seqs)
    values, ids = logprobs.topk(k, dim=-1)  # [S, k]
    return [tuple(zip(ids[i, :n].tolist(), values[i, :n].tolist(), strict=True))
            for i, n in enumerate(seq.params.top_logprobs for seq in seqs)]


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    out = logits
    for i, seq in enumerate(seqs):
        p = seq.params
        min_tokens_active = _min_tokens_active(seq)
        if p.repetition_penalty == 1.0 and not min_tokens_active:
            continue
        if out is logits:
            out = logits.clone()
        row = out[i]
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(seq.token_ids, device=row.device).unique()
            scores = row[ids]
            row[ids] = torch.where(scores < 0, scores * p.repetition_penalty,
                                   scores / p.repetition_penalty)
        if min_tokens_active:
            row[list(seq.eos_token_ids)] = float("-inf")
    return out


def _min_tokens_active(seq: Sequence) -> bool:
    """EOS is still masked: fewer than min_new_tokens generated (and EOS not ignored)."""
    p = seq.params
    return bool(not p.ignore_eos and seq.num_output_tokens < p.min_new_tokens
                and seq.eos_token_ids)


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return (p.greedy and p.repetition_penalty == 1.0 and p.top_logprobs == 0
            and not _min_tokens_active(seq))


def _draw(row: torch.Tensor, seq: Sequence, greedy_choice: int) -> int:
    """One seeded draw from temperature / top-k / top-p of one row ([vocab] float32)."""
    p = seq.params
    row = row / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - p.top_p
        remove[-1] = False  # always keep the most likely token
        row = row.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    probs = row.softmax(-1)
    if not torch.isfinite(probs).all():  # degenerate logits: never fail the whole batch
        return greedy_choice
    generator = torch.Generator(device=row.device)
    generator.manual_seed((seq.sampling_seed * _SEED_MIX + seq.num_output_tokens) % 2**63)
    return int(torch.multinomial(probs, 1, generator=generator))
