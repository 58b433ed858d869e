"""Asynchronous scheduling: step n+1 is planned and launched before step n's tokens reach the
host (its inputs read on the device), yet every strategy gives transformers' greedy tokens, EOS
and stop strings end sequences where in-order steps do, and the start-up check turns it off,
loudly, when the two ways disagree. Proved on CPU: the same pipeline runs there, unoverlapped."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineClient, GenerationRequest, SamplingParams
from engine.guided import GuidedSpec
from engine.observe.async_check import choose_async_scheduling
from engine.runner.sampler import SampledRows
from engine.runner.step_buffer import StepBuffer
from tests.engine_harness import (
    Req,
    drive,
    greedy,
    hf_greedy,
    make_engine,
    prompts_with_references,
    staggered_requests,
)
from tests.models_fixtures import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("async"), arch="llama")
    new_tokens = [10, 4, 15, 7, 1, 12]
    prompts, refs = prompts_with_references(path, 11, 13, (0, 4), (1, 29, 8, 17), new_tokens)
    return path, prompts, new_tokens, refs


def staggered(prompts, new_tokens) -> list[Req]:
    return staggered_requests(prompts, new_tokens, [0, 0, 1, 3, 6, 7])


def count_launches(engine) -> list[tuple[int, int]]:
    """Per launch: (scheduled sequences whose input was still on the device, tokens)."""
    counts: list[tuple[int, int]] = []
    launch = engine.runner.launch

    def counting(batch):
        counts.append((sum(seq.num_pending for seq in batch.seqs), batch.num_tokens))
        return launch(batch)
    engine.runner.launch = counting
    return counts


STRATEGIES = [
    ("none", {}),
    ("dynamic", {"max_num_seqs": 2, "max_batch_delay_ms": 5.0}),
    ("continuous", {"max_num_batched_tokens": 20}),
    ("paged", {"block_size": 4}),
    ("paged", {"block_size": 4, "max_num_batched_tokens": 3, "enable_prefix_caching": True}),
    ("paged", {"block_size": 4, "num_kv_blocks": 14}),  # preempts
]


@pytest.mark.parametrize(("batching", "overrides"), STRATEGIES,
                         ids=[f"{b}-{i}" for i, (b, _) in enumerate(STRATEGIES)])
def test_planned_ahead_steps_give_generate_greedy_tokens(tiny, batching, overrides) -> None:
    """Every strategy, with chunked prefill, prefix caching and preemption: equal to generate;
    the steps really were planned before their inputs reached the host, and no sequence was
    computed past its last token (no EOS here: the in-order engine computes as many)."""
    path, prompts, new_tokens, refs = tiny
    launches = []
    for ahead in (False, True):
        engine = make_engine(path, batching, async_scheduling=ahead, **overrides)
        assert engine.async_scheduling is ahead
        launches.append(count_launches(engine))
        reqs = staggered(prompts, new_tokens)
        drive(engine, reqs)
        assert [r.tokens for r in reqs] == refs
        if overrides.get("num_kv_blocks"):
            assert engine.scheduler.num_preemptions > 0
    in_order, planned_ahead = launches
    assert sum(p for p, _ in in_order) == 0
    assert sum(p for p, _ in planned_ahead) > len(planned_ahead) // 2, "few inputs were ahead"
    if not overrides.get("num_kv_blocks"):  # preemption may pick other victims either way
        assert sum(n for _, n in planned_ahead) == sum(n for _, n in in_order)


def run_both(path, reqs_of, eos: int | None = None, **overrides):
    """The same requests on an in-order engine and a planned-ahead one: their events."""
    results = []
    for ahead in (False, True):
        engine = make_engine(path, "paged", async_scheduling=ahead, **overrides)
        assert engine.async_scheduling is ahead
        if eos is not None:
            engine.eos_token_ids = frozenset({eos})
        reqs = reqs_of()
        events = {r.request_id: [] for r in reqs}
        for r in reqs:
            engine.add_request(r.request_id, r.prompt, r.params)
        while engine.has_unfinished():
            for event in engine.step():
                events[event.request_id].append(event)
            engine.scheduler.check_integrity()
        allocator = engine.scheduler.allocator
        assert allocator.num_free_blocks == allocator.num_blocks, "KV leaked"
        results.append(events)
    return results


def summary(events) -> dict:
    return {rid: ([e.token_id for e in evs if e.token_id is not None], evs[-1].finish_reason,
                  evs[-1].num_output_tokens, "".join(e.text for e in evs))
            for rid, evs in events.items()}


def test_eos_ends_a_sequence_where_in_order_steps_end_it(tiny) -> None:
    """The token computed past EOS is dropped: same tokens, reason and counts both ways."""
    path, prompts, _, refs = tiny
    eos = refs[0][4]
    first = refs[0].index(eos) + 1  # greedy reaches it at this token of the first request

    def reqs():
        return [Req(f"e{i}", p, SamplingParams(max_new_tokens=14))
                for i, p in enumerate(prompts)]
    in_order, ahead = run_both(path, reqs, eos=eos, max_num_seqs=6)
    assert summary(ahead) == summary(in_order)
    assert summary(ahead)["e0"][1:3] == ("eos_token", first)


def test_stop_strings_and_mixed_parameters_match_in_order_steps(tiny) -> None:
    """Stop strings (found one step later: the extra token is never returned), seeded
    sampling, penalties, logprobs and a grammar in one batch: the same events both ways."""
    path, prompts, _, refs = tiny
    tokenizer = make_engine(path, "none").tokenizer
    text = tokenizer.decode(refs[2])
    at = len(tokenizer.decode(refs[2][:6]))
    stop = text[at:at + 2]
    assert stop.strip(), "the reference continuation has no text to stop on"

    def reqs():
        return [
            Req("stop", prompts[2], SamplingParams(max_new_tokens=20, ignore_eos=True,
                                                   stop=(stop,))),
            Req("seeded", prompts[1], SamplingParams(max_new_tokens=12, do_sample=True,
                                                     temperature=0.9, top_p=0.8, seed=5,
                                                     ignore_eos=True, top_logprobs=2)),
            Req("penalised", prompts[3], SamplingParams(max_new_tokens=9, ignore_eos=True,
                                                        repetition_penalty=1.4,
                                                        frequency_penalty=0.5)),
            Req("guided", prompts[4], SamplingParams(max_new_tokens=12,
                                                     guided=GuidedSpec("regex", "[a-z]{3,6}"))),
            Req("plain", prompts[5], SamplingParams(max_new_tokens=11, ignore_eos=True)),
        ]
    in_order, ahead = run_both(path, reqs, max_num_seqs=5)
    assert summary(ahead) == summary(in_order)
    assert summary(ahead)["stop"][1] == "stop_sequence"


def test_an_abort_while_its_token_is_on_the_device_frees_its_kv(tiny) -> None:
    path, prompts, new_tokens, refs = tiny
    engine = make_engine(path, "paged", async_scheduling=True)
    engine.add_request("gone", prompts[3], greedy(20))
    engine.add_request("kept", prompts[2], greedy(new_tokens[2]))
    for _ in range(4):
        engine.step()
    assert any(seq.num_pending for seq in engine.scheduler.running)
    engine.abort("gone")
    tokens = []
    while engine.has_unfinished():
        events = engine.step()
        assert all(e.request_id == "kept" for e in events)
        tokens += [e.token_id for e in events if e.token_id is not None]
    assert tokens == refs[2][-len(tokens):]
    allocator = engine.scheduler.allocator
    assert allocator.num_free_blocks == allocator.num_blocks


def test_a_failing_launch_ends_its_batch_after_the_step_in_flight_reports(tiny) -> None:
    """Launching step n+1 fails: step n's tokens still stand and are reported, then the
    requests of step n+1 end with an error; the engine serves on."""
    path, prompts, new_tokens, refs = tiny
    engine = make_engine(path, "paged", async_scheduling=True)
    engine.add_request("a", prompts[3], greedy(20))
    engine.step()
    engine.step()
    launch = engine.runner.launch
    engine.runner.launch = lambda batch: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError):
        engine.step_outputs()
    ended = engine.fail_last_batch("engine failure")
    assert [(o.request_id, o.finish_reason) for o in ended] == [("a", None), ("a", "error")]
    assert ended[0].token_id == refs[3][1]  # the second token, computed before the failure
    assert not engine.has_unfinished()
    engine.runner.launch = launch
    reqs = [Req("b", prompts[2], greedy(new_tokens[2]))]
    drive(engine, reqs)
    assert reqs[0].tokens == refs[2]


@pytest.mark.parametrize("failing_launch", [2, 3, 4])
def test_no_request_is_lost_when_a_step_fails_after_another_was_read(tiny,
                                                                     failing_launch) -> None:
    """A penalised request makes the engine read step n before planning n+1; if that planning
    or launch then fails, what step n finished is still reported: every request ends."""
    path, prompts, _, _ = tiny
    engine = make_engine(path, "paged", async_scheduling=True)
    engine.add_request("pen", prompts[1], SamplingParams(max_new_tokens=2, ignore_eos=True,
                                                         repetition_penalty=1.3))
    engine.add_request("plain", prompts[2], greedy(6))
    launch, calls = engine.runner.launch, []

    def failing(batch):
        calls.append(1)
        if len(calls) == failing_launch:
            raise RuntimeError("device lost")
        return launch(batch)
    engine.runner.launch = failing
    finals = {}
    while engine.has_unfinished():
        try:
            outputs = engine.step_outputs()
        except RuntimeError:
            outputs = engine.fail_last_batch("engine failure")
        finals.update({o.request_id: o.finish_reason for o in outputs if o.finish_reason})
    assert set(finals) == {"pen", "plain"}
    assert engine.scheduler.allocator.num_free_blocks == engine.scheduler.allocator.num_blocks


def test_a_start_up_check_that_disagrees_turns_it_off_loudly(tiny, monkeypatch, caplog) -> None:
    """Inputs read from the wrong place on the device: the start-up check sees other tokens,
    says why, and the engine runs steps in order (and still right)."""
    path, prompts, new_tokens, refs = tiny
    monkeypatch.setattr(SampledRows, "ids", lambda self: self.packed[:, 0].long() + 1)
    with caplog.at_level(logging.WARNING, logger="engine.observe.async_check"):
        engine = make_engine(path, "paged", async_scheduling=True)
    assert not engine.async_scheduling
    assert "asynchronous scheduling is off" in caplog.text and "differ" in caplog.text
    reqs = staggered(prompts, new_tokens)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs


def test_auto_is_off_on_cpu_and_under_tensor_parallelism(tiny, caplog) -> None:
    """Auto: on CPU the forward runs on the host thread, so there is nothing to overlap; under
    tensor parallelism the worker ranks need each step's inputs on the host (asked: a warning)."""
    engine = make_engine(tiny[0], "paged")
    assert engine.config.async_scheduling is None and not engine.async_scheduling
    engine.runner.peers = object()  # stands for the worker ranks: only its presence counts
    try:
        with caplog.at_level(logging.WARNING, logger="engine.observe.async_check"):
            assert not choose_async_scheduling(engine)
            assert "asynchronous scheduling" not in caplog.text  # auto: quietly off
            engine.config = dataclasses.replace(engine.config, async_scheduling=True)
            assert not choose_async_scheduling(engine)
        assert "off under tensor parallelism" in caplog.text
    finally:
        engine.runner.peers = None


def test_served_requests_stream_generate_tokens_planned_ahead(tiny) -> None:
    """Through the engine loop (core thread + output thread), concurrent streams."""
    path, prompts, new_tokens, refs = tiny
    client = EngineClient(make_engine(path, "paged", async_scheduling=True, max_num_seqs=6),
                          max_queued=8)
    client.start()
    try:
        handles = client.submit_all([GenerationRequest(tuple(p), greedy(n))
                                     for p, n in zip(prompts, new_tokens, strict=True)])
        streams = [list(handle.events()) for handle in handles]
    finally:
        client.shutdown(grace_seconds=0)
    assert [[e.token_id for e in events if e.token_id is not None] for events in streams] == refs
    assert all(events[-1].finish_reason == "length" for events in streams)


def test_a_separate_device_packs_each_step_in_the_other_host_buffer() -> None:
    """Step n+1 is packed while step n's upload may still read its host buffer: on a device
    other than the CPU (meta stands for CUDA here) consecutive steps never share one, and a
    step that grows the buffer leaves the previous step's values alone."""
    buffer = StepBuffer(torch.device("meta"), capacity=8)
    steps = [[1, 2, 3], [4, 5], [6, 7, 8, 9], list(range(10, 30)), [30, 31]]
    previous: tuple[torch.Tensor, list[int]] | None = None
    for values in steps:
        buffer.reset()
        buffer.put("tokens", values)
        assert buffer.upload()["tokens"].shape == (len(values),)
        if previous is not None:
            host, written = previous
            assert buffer.host.data_ptr() != host.data_ptr()
            assert host[:len(written)].tolist() == written, "the step in flight was overwritten"
        previous = buffer.host, values
    on_cpu = StepBuffer(torch.device("cpu"))
    assert on_cpu.dev is on_cpu.host  # one buffer: the CPU computes it before the next step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_planned_ahead_on_cuda_gives_generate_greedy_tokens(tiny, enforce_eager) -> None:
    """On a GPU the overlap is real (non-blocking copies, events, graphs): the same tokens as
    generate on CUDA, with and without CUDA graphs for decode."""
    path, prompts, new_tokens, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    engine = make_engine(path, "paged", device="cuda", async_scheduling=True,
                         enforce_eager=enforce_eager, max_num_batched_tokens=8)
    assert engine.async_scheduling
    reqs = staggered(prompts, new_tokens)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
