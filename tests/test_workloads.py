"""Benchmark workloads and load plans: lengths, files and the options that build them."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from benchmark.loadgen import LoadPlan
from benchmark.options import add_load_options, load_plan, requests_for, workload_jobs
from benchmark.workloads import Lengths, jsonl_jobs, synthetic_jobs, word_pool
from tests.models_fixtures import build_tokenizer


def test_lengths_parse_and_sample_within_bounds() -> None:
    rng = random.Random(0)
    assert {Lengths.parse("64", "x").sample(rng) for _ in range(5)} == {64}
    uniform = [Lengths.parse("uniform:10:20", "x").sample(rng) for _ in range(200)]
    assert min(uniform) >= 10 and max(uniform) <= 20 and len(set(uniform)) > 5
    assert min(Lengths.parse("normal:3:50", "x").sample(rng) for _ in range(200)) >= 1
    for bad in ("0", "uniform:5:1", "normal:1", "lognormal:1:2", "many", "uniform:0:4"):
        with pytest.raises(ValueError, match="--prompt-tokens: expected N"):
            Lengths.parse(bad, "--prompt-tokens")


def test_synthetic_prompts_have_the_drawn_token_counts(tmp_path) -> None:
    tokenizer = build_tokenizer(tmp_path)
    assert len(word_pool(tokenizer)) >= 3  # words of the tiny vocabulary, one token each
    jobs = synthetic_jobs(12, Lengths.parse("uniform:5:40", "p"), Lengths.parse("7", "o"),
                          seed=3, tokenizer=tokenizer)
    rng = random.Random(3)
    expected = []
    for _ in range(12):  # the same draws, in the same order
        expected.append(Lengths.parse("uniform:5:40", "p").sample(rng))
        rng.choices(["w"], k=expected[-1])
        Lengths.parse("7", "o").sample(rng)
    assert [len(tokenizer.encode(j.prompt)) for j in jobs] == expected
    assert {j.new_tokens for j in jobs} == {7}
    again = synthetic_jobs(12, Lengths.parse("uniform:5:40", "p"), Lengths.parse("7", "o"),
                           seed=3, tokenizer=tokenizer)
    assert again == jobs  # the seed fixes the workload


def test_jsonl_prompts_cycle_and_bad_lines_name_their_line(tmp_path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"inputs": "one", "max_new_tokens": 5}\n\n{"prompt": "two"}\n'
                    '{"text": "three", "parameters": {"max_new_tokens": 9}}\n')
    jobs = jsonl_jobs(path, 7, Lengths.parse("11", "o"))
    assert [(j.prompt, j.new_tokens) for j in jobs[:4]] == [
        ("one", 5), ("two", 11), ("three", 9), ("one", 5)]
    assert len(jobs) == 7
    for line, message in (("{not json", ":1: not JSON"), ('{"inputs": 3}', ":1: needs a non"),
                          ('{"inputs": "x", "max_new_tokens": 0}', ":1: max_new_tokens must")):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            jsonl_jobs(path, 1, Lengths.parse("4", "o"))
    path.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        jsonl_jobs(path, 1, Lengths.parse("4", "o"))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_load_options(parser)
    return parser.parse_args(list(argv))


def test_options_build_the_plan_and_the_workload(tmp_path) -> None:
    assert load_plan(parse()) == LoadPlan(32, 96)
    plan = load_plan(parse("--duration", "30", "--rate", "2.5", "-c", "8", "--seed", "4"))
    assert (plan.num_requests, plan.duration_s, plan.request_rate, plan.seed) == (None, 30, 2.5,
                                                                                 4)
    assert "Poisson arrivals at 2.5 req/s" in plan.describe() and "30 s" in plan.describe()
    jobs, described = workload_jobs(parse(), None)
    assert [j.new_tokens for j in jobs] == [64, 256, 128] and "LMI" in described
    build_tokenizer(tmp_path)
    jobs, described = workload_jobs(parse("--workload", "synthetic", "-n", "5",
                                          "--prompt-tokens", "6", "--output-tokens", "3"),
                                    tmp_path)
    assert len(jobs) == 5 and "synthetic" in described and "approximate" not in described
    (tmp_path / "p.jsonl").write_text(json.dumps({"inputs": "hi"}) + "\n")
    jobs, _ = workload_jobs(parse("--workload", str(tmp_path / "p.jsonl"), "-n", "2"), None)
    assert jobs[0].prompt == "hi"
    with pytest.raises(ValueError, match="not lmi, synthetic or a JSONL file"):
        workload_jobs(parse("--workload", str(tmp_path / "missing.jsonl")), None)
    with pytest.raises(ValueError, match="request rate must be > 0"):
        LoadPlan(4, 10, request_rate=0)


def test_requests_for_names_a_strategy_of_the_sweep_and_a_count() -> None:
    strategies = ["none", "dynamic", "paged"]
    assert requests_for(["none=32", "paged=320"], strategies) == {"none": 32, "paged": 320}
    assert requests_for([], strategies) == {}
    with pytest.raises(ValueError, match="'vllm' is not a strategy of this sweep"):
        requests_for(["vllm=5"], strategies)
    for bad in ("none=0", "none=-3", "none=lots", "none"):
        with pytest.raises(ValueError, match="needs a whole number of requests >= 1"):
            requests_for([bad], strategies)


def test_synthetic_lengths_count_the_bos_token_the_server_adds(tmp_path) -> None:
    from tokenizers import processors

    tokenizer = build_tokenizer(tmp_path)
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    jobs = synthetic_jobs(5, Lengths.parse("12", "p"), Lengths.parse("2", "o"), 1, tokenizer)
    assert all(tokenizer.encode(j.prompt)[0] == bos for j in jobs)
    assert [len(tokenizer.encode(j.prompt)) for j in jobs] == [12] * 5


class RecordingTarget:
    """A target that answers at once and keeps the start time it was given."""

    def __init__(self, fail_every: int = 0) -> None:
        self.starts: list[float] = []
        self.fail_every = fail_every

    def send(self, job, *, stream, start=None, on_token=None):
        from benchmark.loadgen import RequestResult

        self.starts.append(start)
        if self.fail_every and len(self.starts) % self.fail_every == 0:
            raise ConnectionResetError("peer went away")
        return RequestResult(ok=True, start=start, end=start + 0.001, token_times=[start],
                             num_output_tokens=1, status=200)


def test_poisson_requests_are_due_at_seeded_exponential_gaps() -> None:
    from benchmark.loadgen import run_load
    from benchmark.workloads import Job

    target = RecordingTarget()
    report = run_load(target, [Job("x", 1)], LoadPlan(2, 40, request_rate=200.0, seed=7),
                      progress=False)
    rng = random.Random(7)
    gaps = [rng.expovariate(200.0) for _ in range(40)]
    starts = sorted(target.starts)
    # each request's clock starts when it was due, not when a client got to it
    assert [b - a for a, b in zip(starts, starts[1:], strict=False)] == pytest.approx(
        gaps[1:], abs=1e-9)
    assert report.num_requests == 40 and report.num_errors == 0


def test_a_client_exception_is_a_failed_request_not_a_stopped_run() -> None:
    from benchmark.loadgen import run_load
    from benchmark.workloads import Job

    report = run_load(RecordingTarget(fail_every=3), [Job("x", 1)], LoadPlan(2, 9),
                      progress=False)
    assert report.num_requests == 9 and report.num_errors == 3
    assert report.errors == ["ConnectionResetError: peer went away"]


def test_plans_refuse_nothing_to_send() -> None:
    for kwargs, message in (({"num_requests": 0}, "requests must be >= 1"),
                            ({"num_requests": None, "duration_s": 0.0}, "duration must be > 0"),
                            ({"concurrency": 0}, "concurrency must be >= 1")):
        with pytest.raises(ValueError, match=message):
            LoadPlan(**kwargs)
    assert load_plan(parse("--duration", "0.5")).num_requests is None


def test_an_endpoint_target_without_a_region_says_so(monkeypatch, tmp_path) -> None:
    from benchmark.targets import SageMakerTarget

    for name in ("AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ValueError, match="pass --region or set AWS_DEFAULT_REGION"):
        SageMakerTarget("my-endpoint")
    assert SageMakerTarget("my-endpoint", "eu-west-1").client.meta.region_name == "eu-west-1"
    local = SageMakerTarget("my-endpoint", endpoint_url="http://127.0.0.1:9")
    assert local.client.meta.endpoint_url == "http://127.0.0.1:9"
