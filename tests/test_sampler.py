"""The batched sampler on CPU: greedy rows are argmax, sampled rows draw from exactly the
distribution transformers' logits processors leave, seeded rows are reproducible whatever batch
they run in, and a degenerate row never fails its batch."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.outputs import SampledToken
from engine.runner.sampler import Sampler, _uniform
from engine.runner.step_buffer import StepBuffer
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

EOS = 3


def seq(prompt=(1, 2, 5), seed: int = 0, outputs: int = 0, **params) -> Sequence:
    s = Sequence(0, list(prompt), SamplingParams(max_new_tokens=50, **params), frozenset({EOS}),
                 seed)
    for token in range(outputs):
        s.num_computed_tokens = s.num_tokens
        s.append_token(7 + token)
    return s


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
    buffer = StepBuffer(torch.device("cpu"))
    plan = Sampler().stage(seqs, buffer)
    return Sampler()(logits, plan, buffer.upload())


def ids(tokens: list[SampledToken]) -> list[int]:
    return [t.token_id for t in tokens]


def test_greedy_rows_are_argmax_with_log_softmax_logprobs() -> None:
    torch.manual_seed(0)
    logits = 4 * torch.randn(5, 50)
    tokens = sample(logits, [seq() for _ in range(5)])
    assert ids(tokens) == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).max(-1).values
    torch.testing.assert_close(torch.tensor([t.logprob for t in tokens]), want)
    mixed = [seq(), seq(do_sample=True, top_k=5, seed=1), seq(), seq(repetition_penalty=1.0)]
    assert [ids(sample(logits[:4], mixed))[i] for i in (0, 2, 3)] == \
        logits[[0, 2, 3]].argmax(-1).tolist()


def test_penalty_and_min_new_tokens_equal_transformers_processors() -> None:
    torch.manual_seed(1)
    logits = 3 * torch.randn(4, 40)
    rows = [seq(prompt=(4, 9, 9, 30), repetition_penalty=1.7),
            seq(prompt=(6,), outputs=1, min_new_tokens=3),
            seq(prompt=(2, 3), repetition_penalty=0.6, min_new_tokens=2),
            seq(prompt=(3,), min_new_tokens=1, ignore_eos=True)]
    want = []
    for row, s in zip(logits, rows, strict=True):
        processors = LogitsProcessorList()
        if s.params.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(s.params.repetition_penalty))
        if not s.params.ignore_eos:
            processors.append(MinNewTokensLengthLogitsProcessor(
                s.num_prompt_tokens, s.params.min_new_tokens, EOS))
        scores = processors(torch.tensor([s.token_ids]), row[None].clone())
        want.append(int(scores.argmax()))
    logits[:, EOS] = logits.max() + 1  # EOS wins unless masked
    assert ids(sample(logits, rows)) == [EOS, *want[1:3], EOS]
    assert ids(sample(logits[:1], rows[:1])) == [EOS]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.7)])
def test_draws_follow_transformers_warpers(temperature, top_k, top_p) -> None:
    """4,000 seeds through one batch: the drawn support is the warpers' support and the
    frequencies match their probabilities."""
    torch.manual_seed(2)
    row = 2 * torch.randn(12)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    want = warpers(torch.zeros(1, 1, dtype=torch.long), row[None].clone()).softmax(-1)[0]
    n = 4000
    params = {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    drawn = torch.tensor(ids(sample(row.expand(n, -1), [seq(seed=s, **params) for s in range(n)])))
    counts = torch.bincount(drawn, minlength=12) / n
    assert set(drawn.tolist()) == set(torch.nonzero(want).flatten().tolist())
    assert (counts - want).abs().max() < 0.03, (counts, want)


def test_top_k_keeps_ties_with_the_kth_score() -> None:
    row = torch.tensor([[0.0, 5.0, 3.0, 3.0, 3.0, -1.0]])
    drawn = {ids(sample(row, [seq(seed=s, do_sample=True, top_k=2)]))[0] for s in range(300)}
    assert drawn == {1, 2, 3, 4}  # as TopKLogitsWarper: scores < the 2nd largest are removed


def test_seeded_rows_do_not_depend_on_their_batch() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 30)
    rows = [seq(seed=11, do_sample=True, temperature=0.8),
            seq(seed=12, do_sample=True, top_k=5, top_p=0.9, repetition_penalty=1.2),
            seq(), seq(seed=13, do_sample=True, top_logprobs=3, min_new_tokens=4)]
    together = sample(logits, rows)
    alone = [sample(logits[i:i + 1], [rows[i]])[0] for i in range(4)]
    assert together == alone
    assert sample(logits, rows) == together  # and again: reproducible


def test_the_uniform_number_spreads_over_seeds_and_positions() -> None:
    values = {_uniform(seed, k) for seed in range(50) for k in range(50)}
    assert len(values) > 2400 and min(values) >= 0 and max(values) < 1
    assert _uniform(7, 3) == _uniform(7, 3)


def test_next_draw_depends_on_the_output_length() -> None:
    row = torch.zeros(1, 1000)  # uniform: the draw is the uniform number's bucket
    draws = {ids(sample(row, [seq(seed=5, outputs=k, do_sample=True)]))[0] for k in range(20)}
    assert len(draws) > 15


def test_degenerate_rows_fall_back_and_spare_the_batch() -> None:
    logits = torch.randn(3, 20)
    logits[1] = float("nan")
    logits[2, :] = float("-inf")
    logits[2, 4] = 1.0
    rows = [seq(seed=1, do_sample=True), seq(seed=2, do_sample=True, top_k=3),
            seq(seed=3, do_sample=True, top_p=0.5)]
    tokens = sample(logits, rows)
    assert all(0 <= t < 20 for t in ids(tokens)) and tokens[2].token_id == 4


def test_top_logprobs_are_the_best_alternatives() -> None:
    torch.manual_seed(4)
    logits = torch.randn(2, 25)
    tokens = sample(logits, [seq(top_logprobs=3), seq(top_logprobs=0)])
    values, best = torch.log_softmax(logits[0], -1).topk(3)
    assert [a for a, _ in tokens[0].top_logprobs] == best.tolist()
    torch.testing.assert_close(torch.tensor([v for _, v in tokens[0].top_logprobs]), values)
    assert tokens[1].top_logprobs == ()


def test_frequency_and_presence_penalties_follow_openais_definition() -> None:
    """logit[j] - count_j * frequency - (count_j > 0) * presence, counted over the output only
    (the prompt's 5 is not penalised); a row without them is untouched."""
    torch.manual_seed(5)
    logits = torch.randn(3, 30)
    top = logits.max()
    logits[:, 7], logits[:, 5] = top + 2, top + 1  # 7 wins unless penalised, then 5
    rows = [seq(prompt=(5, 5), outputs=3, frequency_penalty=0.7, presence_penalty=-0.4),
            seq(prompt=(5,), outputs=2, presence_penalty=1.5),
            seq(prompt=(5,), outputs=2)]
    rows[0].token_ids += [7, 7]  # output 7, 8, 9, 7, 7: token 7 three times
    want = logits.clone()
    for r, s in enumerate(rows):
        output, p = s.output_token_ids, s.params
        for token in set(output):
            want[r, token] -= output.count(token) * p.frequency_penalty + p.presence_penalty
    assert want.argmax(-1).tolist() == [5, 5, 7]
    assert ids(sample(logits, rows)) == [5, 5, 7]
    tokens = sample(logits[:2], rows[:2])
    torch.testing.assert_close(torch.tensor([t.logprob for t in tokens]),
                               torch.log_softmax(logits[:2], -1)[:, 5])  # raw log-probs
