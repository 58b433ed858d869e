"""Batched sampling: each row's parameters as tensors, one pass for the batch, one host copy.

The host stages what it knows before the logits exist (stage: temperatures, top-k/top-p,
penalties, the EOS mask, a uniform draw per row); the device then runs the whole batch through
the same ops and packs ids, log-probabilities and alternatives into one tensor, copied to the
host once. No row loops, no `.item()`: nothing on the device waits for the host mid-step.

Processors run in transformers' order (repetition penalty, min-new-tokens EOS mask, then
temperature, top-k, top-p), so greedy rows equal `generate` exactly. A sampled row draws by
inverse CDF with one uniform number derived from (its seed, its output length) alone, so a
seeded request gives the same tokens whatever batch it runs in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from engine.outputs import SampledToken
from engine.runner.step_buffer import StepBuffer
from engine.sequence import Constraint, Sequence

if TYPE_CHECKING:
    from engine.guided import Constraint as GrammarState

# logits [S, vocab] float32 → [S, 2] float64 (argmax id, its log-probability; NaN where the
# kernel cannot tell, e.g. a row holding NaN): a faster greedy path (the CPU C kernel)
GreedyKernel = Callable[[torch.Tensor], torch.Tensor]

_MASK64 = (1 << 64) - 1
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) over the generator's input space


@dataclass(frozen=True)
class SamplingPlan:
    """What the host knows about a step's sampled rows; decides which ops run at all."""

    top_logprobs: tuple[int, ...]  # alternatives each row asked for
    plain_greedy: bool  # every row: argmax of the raw logits, no processor
    any_sampled: bool
    any_top_k: bool
    any_top_p: bool
    any_penalty: bool
    any_eos_mask: bool
    any_openai_penalty: bool = False  # frequency or presence
    # (constraint, row) of the rows a grammar guides: their masks are filled while the forward
    # runs, then uploaded with one copy
    guided: tuple[tuple[Constraint, int], ...] = ()


class Sampler:
    """stage() on the host before the step's upload; __call__ on the logits after forward."""

    def __init__(self, greedy: GreedyKernel | None = None) -> None:
        self.greedy = greedy
        self.masks = GrammarMasks()

    def stage(self, seqs: list[Sequence], buffer: StepBuffer) -> SamplingPlan:
        """Write the rows' parameters into `buffer` (sections s_*); nothing for plain greedy."""
        if all(seq.params.argmax_only and seq.constraint is None and not _eos_masked(seq)
               for seq in seqs):  # the common case, decided in one pass
            return SamplingPlan(tuple(seq.params.top_logprobs for seq in seqs), plain_greedy=True,
                                any_sampled=False, any_top_k=False, any_top_p=False,
                                any_penalty=False, any_eos_mask=False)
        params = [seq.params for seq in seqs]
        eos_masked: list[int] = [_eos_masked(seq) for seq in seqs]  # bools, rows of ints
        guided = tuple((seq.constraint, i) for i, seq in enumerate(seqs)
                       if seq.constraint is not None)
        counted = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
        plan = SamplingPlan(
            top_logprobs=tuple(p.top_logprobs for p in params),
            plain_greedy=False,  # some row is sampled, penalised, EOS-masked or guided
            any_sampled=any(not p.greedy for p in params),
            any_top_k=any(not p.greedy and p.top_k > 0 for p in params),
            any_top_p=any(not p.greedy and p.top_p < 1.0 for p in params),
            any_penalty=any(p.repetition_penalty != 1.0 for p in params),
            any_eos_mask=any(eos_masked), any_openai_penalty=bool(counted), guided=guided)
        buffer.put("s_ints", [[int(p.greedy) for p in params], eos_masked,
                              [p.top_k for p in params]], shape=(3, len(seqs)))
        buffer.put_floats("s_floats", [
            [1.0 if p.greedy else p.temperature for p in params],
            [p.top_p for p in params], [p.repetition_penalty for p in params],
            [0.0 if seq.params.greedy else _uniform(seq.sampling_seed, seq.num_output_tokens)
             for seq in seqs]], shape=(4, len(seqs)))
        if plan.any_penalty:
            rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
            buffer.put("s_penalty_rows", [i for i in rows for _ in seqs[i].token_ids])
            buffer.put("s_penalty_tokens", [t for i in rows for t in seqs[i].token_ids])
        if counted:  # each generated token once per occurrence: counts add up on the device
            buffer.put_floats("s_openai", [[p.frequency_penalty for p in params],
                                           [p.presence_penalty for p in params]],
                              shape=(2, len(seqs)))
            buffer.put("s_count_rows", [i for i in counted for _ in seqs[i].output_token_ids])
            buffer.put("s_count_tokens", [t for i in counted for t in seqs[i].output_token_ids])
        if plan.any_eos_mask:
            buffer.put("s_eos_ids", sorted(set().union(*(s.eos_token_ids for s in seqs))))
        return plan

    def __call__(self, logits: torch.Tensor, plan: SamplingPlan,
                 views: dict[str, torch.Tensor]) -> list[SampledToken]:
        """logits [S, vocab] float32 → one token per row, through one device-to-host copy."""
        return self.launch(logits, plan, views).tokens()

    def launch(self, logits: torch.Tensor, plan: SamplingPlan,
               views: dict[str, torch.Tensor]) -> SampledRows:
        """Queue the batch's sampling and its one device-to-host copy; wait for neither."""
        if plan.plain_greedy and self.greedy is not None and max(plan.top_logprobs) == 0:
            packed = self.greedy(logits)  # computed on the host, here and now
            host: torch.Tensor | np.ndarray = packed.numpy()
            if not np.isnan(host[:, 1]).any():
                return SampledRows(packed, host, None, plan)
        if plan.guided:  # the host's grammar work overlaps the device's forward
            views = {**views, "s_grammar": self.masks.fill(plan, logits.shape[0], logits.device)}
        packed = sample(logits, plan, views)
        if packed.device.type == "cpu":
            return SampledRows(packed, packed.numpy(), None, plan)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return SampledRows(packed, host, done, plan)


class SampledRows:
    """One step's sampled rows: packed [S, 2 + 2k] float64 on the device, whose ids the next
    step may read there (asynchronous scheduling), and their host copy, ready once `done`."""

    def __init__(self, packed: torch.Tensor, host: torch.Tensor | np.ndarray,
                 done: torch.cuda.Event | None, plan: SamplingPlan) -> None:
        self.packed = packed
        self._host = host
        self._done = done
        self._plan = plan

    def ids(self) -> torch.Tensor:
        """[S] int64 on the device: the sampled token ids."""
        return self.packed[:, 0].long()

    def tokens(self) -> list[SampledToken]:
        """Wait for the copy, then one SampledToken per row."""
        host = self._host
        if self._done is not None:  # then a pinned tensor the device copies into
            self._done.synchronize()
            host = cast(torch.Tensor, host).numpy()
        return unpack(cast(np.ndarray, host), self._plan)


def sample(logits: torch.Tensor, plan: SamplingPlan,
           views: dict[str, torch.Tensor]) -> torch.Tensor:
    """logits [S, vocab] float32 → [S, 2 + 2k] float64: chosen id, its log-probability under
    the raw model distribution, then k alternative ids and their log-probabilities."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [S, vocab]
    if plan.plain_greedy:
        chosen = logits.argmax(dim=-1)  # [S]
    else:
        greedy_row, eos_masked, top_k = views["s_ints"]
        temperature, top_p, penalty, uniform = views["s_floats"].float()
        scores = _penalised(logits, plan, views, penalty, eos_masked)
        chosen = scores.argmax(dim=-1)
        if plan.any_sampled:
            drawn = _draw(scores / temperature[:, None], plan, top_k, top_p, uniform, chosen)
            chosen = torch.where(greedy_row.bool(), chosen, drawn)
    columns = [chosen[:, None], logprobs.gather(1, chosen[:, None])]
    k = max(plan.top_logprobs)
    if k:
        values, ids = logprobs.topk(k, dim=-1)  # [S, k]
        columns += [ids, values]
    return torch.cat([c.double() for c in columns], dim=1)


def unpack(host: np.ndarray, plan: SamplingPlan) -> list[SampledToken]:
    """The packed [S, 2 + 2k] rows on the host → one SampledToken per row."""
    ids, picked = host[:, 0].astype(np.int64).tolist(), host[:, 1].tolist()
    k = (host.shape[1] - 2) // 2
    if k == 0:
        return [SampledToken(token, logprob) for token, logprob in zip(ids, picked, strict=True)]
    alt_ids, alt_values = host[:, 2:2 + k].astype(np.int64).tolist(), host[:, 2 + k:].tolist()
    return [SampledToken(ids[i], picked[i], tuple(zip(alt_ids[i][:n], alt_values[i][:n],
                                                      strict=True)))
            for i, n in enumerate(plan.top_logprobs)]


def _penalised(logits: torch.Tensor, plan: SamplingPlan, views: dict[str, torch.Tensor],
               penalty: torch.Tensor, eos_masked: torch.Tensor) -> torch.Tensor:
    """Repetition penalty over each row's prompt + output tokens, OpenAI's frequency and
    presence penalties over its output tokens, then the EOS and grammar masks."""
    scores = logits
    if plan.any_penalty:
        seen = torch.zeros_like(logits, dtype=torch.bool)  # [S, vocab]
        seen[views["s_penalty_rows"], views["s_penalty_tokens"]] = True
        p = penalty[:, None]
        scores = torch.where(seen, torch.where(scores < 0, scores * p, scores / p), scores)
    if plan.any_openai_penalty:
        frequency, presence = views["s_openai"].float()  # [S] each
        counts = torch.zeros_like(logits)  # [S, vocab]
        rows = views["s_count_rows"]
        counts.index_put_((rows, views["s_count_tokens"]),
                          torch.ones_like(rows, dtype=counts.dtype), accumulate=True)
        scores = scores - counts * frequency[:, None] - (counts > 0) * presence[:, None]
    if plan.any_eos_mask:
        eos = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)  # [vocab]
        eos[views["s_eos_ids"]] = True
        scores = scores.masked_fill(eos_masked.bool()[:, None] & eos, float("-inf"))
    if plan.guided:
        scores = scores.masked_fill(~allowed_tokens(views["s_grammar"], logits.shape[1]),
                                    float("-inf"))
    return scores


def _draw(scores: torch.Tensor, plan: SamplingPlan, top_k: torch.Tensor, top_p: torch.Tensor,
          uniform: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """scores [S, vocab] already divided by temperature → one drawn id per row; a row whose
    distribution is degenerate (NaN, all masked) keeps `fallback` instead of failing the batch.

    Rows with top-k or top-p draw in sorted order, the others in vocabulary order, whatever
    their neighbours ask for: a row's token depends on its own parameters and seed only."""
    drawn, ok = _inverse_cdf(scores, uniform)
    if plan.any_top_k or plan.any_top_p:
        vocab = scores.shape[1]
        # Ascending, as transformers' top-p sorts; top-k then keeps ties with the k-th largest.
        ranked, order = scores.sort(dim=-1)
        if plan.any_top_k:
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
            kth = ranked.gather(1, (vocab - k)[:, None])  # [S, 1]
            ranked = ranked.masked_fill(ranked < kth, float("-inf"))
        if plan.any_top_p:
            cumulative = ranked.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - top_p)[:, None]
            remove[:, -1] = False  # always keep the most likely token
            ranked = ranked.masked_fill(remove, float("-inf"))
        at, ranked_ok = _inverse_cdf(ranked, uniform)
        filtered = (top_k > 0) | (top_p < 1)
        drawn = torch.where(filtered, order.gather(1, at[:, None]).squeeze(1), drawn)
        ok = torch.where(filtered, ranked_ok, ok)
    return torch.where(ok, drawn, fallback)


def _inverse_cdf(scores: torch.Tensor, uniform: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the index where the cumulative softmax of `scores` [S, n] passes `uniform` [S];
    and whether that index has a positive probability (False for NaN or all-masked rows)."""
    probs = scores.softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)  # [S, n]
    at = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
    at = at.clamp_(max=scores.shape[1] - 1)  # [S, 1]
    return at.squeeze(1), probs.gather(1, at).squeeze(1) > 0


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [S, W] int32 (bit j of word w: token 32w + j is allowed) → [S, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)  # [S, 32W]
    if bits.shape[1] < vocab:  # ids the tokenizer lacks: never allowed
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]))
    return bits[:, :vocab]


class GrammarMasks:
    """The guided rows' allowed-token bitmasks, filled by llguidance on the host (its own
    threads, into a persistent buffer, pinned on CUDA) and copied to the device at once.
    Unguided rows allow everything."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # [rows, W] int32

    def fill(self, plan: SamplingPlan, rows: int, device: torch.device) -> torch.Tensor:
        guided = cast("tuple[tuple[GrammarState, int], ...]", plan.guided)  # engine/guided.py's
        constraint = guided[0][0]
        words = (constraint.matcher_vocab + 31) // 32
        host = self._buffer(rows, words, device)[:rows]
        host.fill_(-1)
        executor = constraint.executor
        executor.unsafe_compute_mask_ptr([(c.matcher, row) for c, row in guided],
                                         host.data_ptr(), words * 4, rows)
        return host if device.type == "cpu" else host.to(device, non_blocking=True)

    def _buffer(self, rows: int, words: int, device: torch.device) -> torch.Tensor:
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] != words:
            host = torch.empty(max(rows, 8), words, dtype=torch.int32,
                               pin_memory=device.type == "cuda")
            self._host = host
        return host


def _eos_masked(seq: Sequence) -> bool:
    """EOS is still masked: fewer than min_new_tokens generated (and EOS not ignored). Never
    for a guided row: its grammar decides where the answer may end."""
    p = seq.params
    return bool(not p.ignore_eos and seq.num_output_tokens < p.min_new_tokens
                and seq.eos_token_ids and seq.constraint is None)


def _uniform(seed: int, counter: int) -> float:
    """A uniform number in [0, 1) from (seed, counter) alone: splitmix64's finaliser, 24 bits so
    float32 holds it exactly."""
    z = (seed * _SEED_MIX + counter + _SEED_MIX) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 40) / float(1 << 24)
