"""Speculative decoding (engine/spec/): output with speculation equals output without it, token
for token, greedy and sampled, in every strategy and around chunked prefill, preemption, prefix
caching, tensor parallelism, KV groups and the padded decode path; the sampled distribution is
the target's (chi-square), and not when the rule is broken on purpose."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from engine import SamplingParams
from engine.runner.sampler import SamplingPlan, sample
from engine.spec import speculator as spec_module
from engine.spec.ngram import propose_ngram
from engine.spec.speculator import Speculator
from tests.engine_harness import Req, drive, hf_greedy, make_engine, prompts_sharing_a_prefix
from tests.models_fixtures import build_tiny_model
from tests.test_kv_groups import KINDS

SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 4, 2, 3, 5, 6, 1, 2, 3]
    assert propose_ngram(tokens, 1, 3, 2) == [9, 4]  # [1, 2, 3] matches at the start
    assert propose_ngram(tokens[:-1] + [7, 2, 3], 1, 2, 3) == [5, 6, 1]  # latest [2, 3]
    assert propose_ngram([4, 5, 6], 1, 3, 4) == []
    assert propose_ngram([8, 8, 8], 2, 2, 4) == [8]


class Oracle:
    """Proposes the true continuation (from a run without speculation), wrong at every third
    proposal's second token: long acceptances, and rejections in the middle."""

    answers: dict[tuple[int, ...], list[int]] = {}

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        for prompt, answer in self.answers.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = list(answer[done:done + k])
                self.calls += 1
                if self.calls % 3 == 0 and len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % 300
                return drafts
        return []


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("spec"))


def prompts_for(seed: int, lengths=(9, 23, 4, 15)) -> list[list[int]]:
    return prompts_sharing_a_prefix(seed, lengths, shared=12)


def run(path, batching: str, prompts, params, spec: bool, oracle: bool = False, **overrides):
    """Tokens per request, and the engine's counters (None without speculation)."""
    engine = make_engine(path, batching, **{**(SPEC if spec else {}), **overrides})
    reqs = [Req(f"r{i}", p, params(i), arrive_at_step=2 * i) for i, p in enumerate(prompts)]
    try:
        if oracle:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(spec_module, "NgramIndex", Oracle)
                drive(engine, reqs)
        else:
            drive(engine, reqs)
    finally:
        engine.close()
    counters = engine.speculator.counters if engine.speculator is not None else None
    run.preemptions = engine.scheduler.num_preemptions  # type: ignore[attr-defined]
    return [r.tokens for r in reqs], counters


def greedy_params(n: int = 24):
    return lambda i: SamplingParams(max_new_tokens=n - 3 * i, ignore_eos=True)


def sampled_params(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=100 + i,
                          do_sample=True, ignore_eos=True)


CASES = {
    "continuous": ("continuous", {}),
    "paged-chunks": ("paged", {"max_num_batched_tokens": 8}),
    "paged-prefix-cache": ("paged", {"enable_prefix_caching": True, "block_size": 4}),
    "paged-preemption": ("paged", {"block_size": 4, "num_kv_blocks": 18}),
    "paged-padded-decode": ("paged", {"padded_decode_on_cpu": True}),
    "dynamic": ("dynamic", {}),
    "none": ("none", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_is_unchanged_by_accepted_and_rejected_proposals(model, case) -> None:
    batching, overrides = CASES[case]
    prompts = prompts_for(1)
    want, _ = run(model, batching, prompts, greedy_params(), spec=False, **overrides)
    Oracle.answers = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    got, counters = run(model, batching, prompts, greedy_params(), spec=True, oracle=True,
                        **overrides)
    assert got == want
    assert counters.drafts > 0 and 0 < counters.accepted_tokens < counters.draft_tokens
    assert counters.acceptance_rate > 0.5
    if case == "paged-preemption":
        assert run.preemptions > 0  # type: ignore[attr-defined]


def test_greedy_output_equals_transformers_with_ngram_proposals(model) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    prompts = [[5, 17, 42, 7, 99, 3, 11] * 3, [9, 8, 7, 6] * 4]
    got, counters = run(model, "paged", prompts, greedy_params(20), spec=True)
    assert got == [hf_greedy(reference, p, 20 - 3 * i) for i, p in enumerate(prompts)]
    assert counters.drafts > 0  # the repeated prompts gave the lookup something to find


@pytest.mark.parametrize("batching", ["continuous", "paged"])
def test_sampled_output_is_the_same_seed_for_seed(model, batching) -> None:
    """Each output position draws from (seed, position) alone: verifying proposals by sampling
    them keeps every token what decoding without speculation samples."""
    prompts = prompts_for(2)
    want, _ = run(model, batching, prompts, sampled_params, spec=False)
    Oracle.answers = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    got, counters = run(model, batching, prompts, sampled_params, spec=True, oracle=True)
    assert got == want and counters.accepted_tokens > 0


def test_tensor_parallel_and_kv_groups(model, tmp_path) -> None:
    prompts = prompts_for(3)
    want, _ = run(model, "paged", prompts, greedy_params(), spec=False)
    Oracle.answers = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    got, counters = run(model, "paged", prompts, greedy_params(), spec=True, oracle=True,
                        tensor_parallel_size=2)
    assert got == want and counters.accepted_tokens > 0
    gemma = build_tiny_model(tmp_path / "gemma3", arch="gemma3", num_hidden_layers=7,
                             layer_types=KINDS)  # windows of 5 beside full layers
    overrides = {"block_size": 4, "max_num_batched_tokens": 8}
    want, _ = run(gemma, "paged", prompts, greedy_params(), spec=False, **overrides)
    Oracle.answers = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    got, counters = run(gemma, "paged", prompts, greedy_params(), spec=True, oracle=True,
                        **overrides)
    assert got == want and counters.accepted_tokens > 0


def test_an_end_inside_an_accepted_run_stops_there(model) -> None:
    """EOS and max_new_tokens cut the accepted proposals: nothing after them is returned."""
    prompt = [5, 17, 42, 7, 99, 3, 11, 2, 250]
    want, _ = run(model, "paged", [prompt], greedy_params(16), spec=False)
    Oracle.answers = {tuple(prompt): want[0]}
    engine = make_engine(model, "paged", **SPEC)
    eos = want[0][6]
    engine.eos_token_ids = frozenset({eos})
    stop_at = want[0].index(eos) + 1
    short = Req("short", prompt, SamplingParams(max_new_tokens=3))
    ending = Req("eos", prompt, SamplingParams(max_new_tokens=16))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spec_module, "NgramIndex", Oracle)
        drive(engine, [short, ending])
    assert short.tokens == want[0][:3]
    assert ending.tokens == want[0][:stop_at]
    assert engine.speculator.counters.accepted_tokens > 0


def test_logprobs_and_counters_follow_the_accepted_tokens(model, caplog) -> None:
    prompt = [5, 17, 42, 7, 99, 3, 11, 2, 250]
    outs, stats = {}, []
    for spec in (False, True):
        engine = make_engine(model, "continuous", **(SPEC if spec else {}))
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, top_logprobs=2)
        engine.add_request("r", prompt, params)
        events = []
        with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.INFO):
            patch.setattr(spec_module, "NgramIndex", Oracle)
            while engine.has_unfinished():
                events += engine.step()
                stats.append(engine.last_step_stats(0.0))
        outs[spec] = [(e.token_id, e.logprob, e.num_output_tokens, e.top_logprobs)
                      for e in events]
        Oracle.answers = {tuple(prompt): [e.token_id for e in events]}
    assert [o[::2] for o in outs[True]] == [o[::2] for o in outs[False]]  # ids, positions
    # log-probabilities: the same up to float rounding (rows computed beside others)
    assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(outs[True], outs[False], strict=True))
    assert all(len(o[3]) == 2 for o in outs[True])
    assert sum(s.spec_accepted_tokens for s in stats) == engine.speculator.counters.accepted_tokens
    assert engine.speculator.counters.accepted_tokens > 0
    assert engine.speculator.log_metrics(force=True).startswith("SpecDecoding metrics")


def test_no_proposals_above_the_disable_batch_size(model) -> None:
    speculator = Speculator(4, 1, 3, 96, disable_batch_size=2)
    engine = make_engine(model, "continuous", **SPEC, speculative_disable_batch_size=2)
    prompts = [[5, 6, 5, 6, 5, 6]] * 3
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.speculator.counters.drafts == 0  # three ran at once
    assert speculator.propose([]) == 0


# -- the distribution: chi-square over a tiny vocabulary --------------------------------------

P = torch.tensor([0.1, 0.2, 0.3, 0.4])  # the target's next-token distribution


def emitted_counts(draws: int, verify) -> torch.Tensor:
    """The first token a verifying step yields, drawn `draws` times through the engine's
    sampler (one uniform per row) against a proposal of token 0."""
    logits = P.log().expand(2, 4).contiguous()
    plan = SamplingPlan((0, 0), plain_greedy=False, any_sampled=True, any_top_k=False,
                        any_top_p=False, any_penalty=False, any_eos_mask=False)
    counts = torch.zeros(4)
    rng = random.Random(5)
    for _ in range(draws):
        views = {"s_ints": torch.tensor([[0, 0], [0, 0], [0, 0]]),
                 "s_floats": torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0],
                                           [rng.random(), rng.random()]])}
        rows = [int(t) for t in sample(logits, plan, views)[:, 0].tolist()]
        yielded = verify([0], rows)
        counts[yielded[0]] += 1
    return counts


def chi_square(counts: torch.Tensor) -> float:
    expected = P * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_verification_keeps_the_target_distribution() -> None:
    from engine.outputs import SampledToken

    speculator = Speculator(1, 1, 1, 96)
    seq = object.__new__(Sequence_)  # verify() only keys its adaptive length by the sequence

    def verify(drafts, rows):
        return [t.token_id for t in speculator.verify(seq, drafts, [SampledToken(r, 0.0)
                                                                    for r in rows])]

    def accept_always(drafts, rows):  # the rule broken on purpose: proposals always stand
        return drafts + rows[len(drafts):]

    critical = 16.27  # chi-square, 3 degrees of freedom, p = 0.001
    assert chi_square(emitted_counts(4000, verify)) < critical
    assert chi_square(emitted_counts(4000, lambda d, rows: rows)) < critical  # no speculation
    assert chi_square(emitted_counts(4000, accept_always)) > critical


class Sequence_:
    """A hashable stand-in for a sequence (weak references need an object)."""


# -- a draft model as the proposer ------------------------------------------------------------

@pytest.fixture(scope="module")
def small_draft(model, tmp_path_factory):
    """One layer, other weights, the same tokenizer: proposes what the target rarely says."""
    return build_tiny_model(tmp_path_factory.mktemp("draft"), seed=1, num_hidden_layers=1)


DRAFT_CASES = {
    "paged-chunks": ("paged", {"max_num_batched_tokens": 8}),
    "paged-preemption": ("paged", {"block_size": 4, "num_kv_blocks": 18}),
}


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_a_draft_model_leaves_greedy_output_unchanged(model, small_draft, case) -> None:
    """The target as its own draft accepts every proposal; a small random one almost none."""
    batching, overrides = DRAFT_CASES[case]
    prompts = prompts_for(4)
    want, _ = run(model, batching, prompts, greedy_params(), spec=False, **overrides)
    for draft, accepted_share in ((model, 1.0), (small_draft, None)):
        got, counters = run(model, batching, prompts, greedy_params(), spec=True, **{
            **overrides, "speculative_method": "draft_model", "speculative_model": str(draft)})
        assert got == want
        assert counters.drafts > 0
        if accepted_share is not None:
            assert counters.acceptance_rate == accepted_share


def test_a_draft_model_keeps_sampled_output_and_works_under_tensor_parallelism(model) -> None:
    prompts = prompts_for(5)
    draft = {"speculative_method": "draft_model", "speculative_model": str(model)}
    want, _ = run(model, "paged", prompts, sampled_params, spec=False)
    got, counters = run(model, "paged", prompts, sampled_params, spec=True, **draft)
    assert got == want and counters.accepted_tokens > 0
    want, _ = run(model, "paged", prompts, greedy_params(), spec=False)
    got, counters = run(model, "paged", prompts, greedy_params(), spec=True,
                        tensor_parallel_size=2, **draft)
    assert got == want and counters.acceptance_rate == 1.0


def test_a_draft_with_another_vocabulary_is_refused(model, tmp_path) -> None:
    other = build_tiny_model(tmp_path / "other", vocab_size=400, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabulary has 400 tokens"):
        make_engine(model, "paged", speculative_method="draft_model",
                    speculative_model=str(other))


# -- scheduling: proposals ride on what is left ------------------------------------------------

def decoding(sched, prompts: list[int]) -> list:
    """Running sequences of these prompt lengths, each decoding (one output token so far)."""
    from tests.test_paged_scheduler import make_seq, run_step

    seqs = [make_seq(i, n, max_new=40) for i, n in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    while any(seq.num_output_tokens == 0 for seq in seqs):
        run_step(sched)
    return seqs


@pytest.mark.parametrize("chunked", [True, False])
def test_proposals_never_starve_a_waiting_prompt(chunked) -> None:
    from tests.test_paged_scheduler import make_paged, make_seq

    sched = make_paged(num_blocks=64, budget=8 if chunked else 16, chunked=chunked)
    a, b = decoding(sched, [3, 3])
    a.propose([1, 2, 3])
    b.propose([1, 2, 3])
    waiting = make_seq(2, 20)
    sched.add(waiting)
    batch = sched.schedule()
    scheduled = dict(zip(batch.seqs, batch.num_scheduled_tokens, strict=True))
    assert waiting in scheduled  # the prompt comes before the proposals
    assert scheduled[a] >= 1 and sum(scheduled.values()) <= max(8 if chunked else 16, 20 + 2)
    for seq in (a, b):
        assert scheduled[seq] == seq.num_uncomputed_tokens  # kept or withdrawn, never half
    sched.check_integrity()


def test_proposals_never_preempt_another_decode() -> None:
    """The one free block goes to the decode that needs it, not to another's proposals."""
    from tests.test_paged_scheduler import make_paged

    sched = make_paged(num_blocks=5, block_size=4, budget=32)
    # a: 3 tokens (its next slot is in its own block); b: 5 (its next needs a new block)
    a, b, c = decoding(sched, [2, 4, 7])  # c holds two blocks: one block left free
    assert sched.allocator.num_free_blocks == 1 and a.num_tokens == 3 and b.num_tokens == 5
    a.propose([5, 6, 7])
    before = sched.num_preemptions
    batch = sched.schedule()
    assert b in batch.seqs and sched.num_preemptions == before
    assert a.num_drafts == 0  # its proposals found no room: dropped
    sched.check_integrity()


def test_proposals_never_cross_longrope_before_the_sequence_does(tmp_path) -> None:
    """Phi-4-mini's shape: past 34 tokens the KV is recomputed once in long mode; proposals
    stop at the boundary instead of forcing that recompute every step."""
    path = build_tiny_model(tmp_path / "phi", arch="phi3_longrope")
    prompts = [[(7 * i) % 250 + 3 for i in range(30)]]
    want, _ = run(path, "paged", prompts, greedy_params(12), spec=False)
    plain_preemptions = run.preemptions  # type: ignore[attr-defined]
    Oracle.answers = {tuple(prompts[0]): want[0]}
    got, counters = run(path, "paged", prompts, greedy_params(12), spec=True, oracle=True)
    assert got == want and counters.accepted_tokens > 0
    assert run.preemptions == plain_preemptions  # type: ignore[attr-defined]
