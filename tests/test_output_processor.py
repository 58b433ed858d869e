"""The output stage: token ids → text deltas and stop strings, offline inline and served on its
own thread, with the engine thread only scheduling and computing."""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from engine import EngineClient, GenerationRequest, SamplingParams
from engine.text.output_processor import OutputProcessor, StepOutput
from tests.engine_harness import greedy, make_engine, wait_until
from tests.models_fixtures import CORPUS, build_tiny_model

PROMPT = (5, 6, 7, 8)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("output-model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def free_run(model_dir) -> tuple[list[int], str]:
    """Greedy ids and text of PROMPT with no stop string: the reference the stops cut."""
    engine = make_engine(model_dir, "continuous")
    engine.add_request("free", PROMPT, greedy(NEW_TOKENS))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    return [e.token_id for e in events], "".join(e.text for e in events)


def outputs_for(request_id: str, ids: list[int], last_reason: str | None = "length"):
    return [StepOutput(request_id, t, -0.5, 3, i + 1,
                       last_reason if i == len(ids) - 1 else None)
            for i, t in enumerate(ids)]


def run_processor(tokenizer, ids: list[int], params: SamplingParams):
    processor = OutputProcessor(tokenizer)
    processor.add("r", params)
    events, stopped = [], []
    for out in outputs_for("r", ids):
        got, ended = processor.process([out])
        events += got
        stopped += ended
    return events, stopped


@pytest.mark.parametrize("sentence", CORPUS)
def test_deltas_are_whole_characters_that_join_to_the_decoded_text(tokenizer,
                                                                   sentence) -> None:
    ids = tokenizer.encode(sentence, add_special_tokens=False)
    events, stopped = run_processor(tokenizer, ids, SamplingParams(max_new_tokens=len(ids)))
    assert "".join(e.text for e in events) == sentence and not stopped
    assert all("\ufffd" not in e.text for e in events)  # never half a multi-byte character
    assert [e.token_id for e in events] == ids and events[-1].finish_reason == "length"


@pytest.mark.parametrize("stop", ["Tokyo", "pital of J", "東京", "🙂 and"])
def test_a_stop_string_ends_the_text_before_it_even_across_tokens(tokenizer, stop) -> None:
    sentence = next(s for s in CORPUS if stop in s)
    ids = tokenizer.encode(sentence, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=len(ids), stop=("never-there", stop))
    events, stopped = run_processor(tokenizer, ids, params)
    assert "".join(e.text for e in events) == sentence[:sentence.index(stop)]
    assert events[-1].finish_reason == "stop_sequence" and stopped == ["r"]
    assert len(events) < len(ids)  # later outputs of a stopped request are dropped


def test_min_new_tokens_defers_the_stop_check(tokenizer) -> None:
    sentence = CORPUS[0]
    ids = tokenizer.encode(sentence, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=len(ids), min_new_tokens=len(ids), stop=("The",))
    events, stopped = run_processor(tokenizer, ids, params)
    assert "".join(e.text for e in events) == sentence and not stopped
    assert events[-1].finish_reason == "length"


def test_an_end_without_a_token_flushes_the_held_back_text(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add("r", SamplingParams(max_new_tokens=9, stop=("a long stop string",)))
    ids = tokenizer.encode("Paris", add_special_tokens=False)
    held, _ = processor.process(outputs_for("r", ids, last_reason=None))
    end, _ = processor.process([StepOutput("r", None, None, 3, len(ids), "abort")])
    assert "".join(e.text for e in held) == ""  # could still be the start of the stop string
    assert end[0].text == "Paris" and end[0].finish_reason == "abort"
    assert processor.process([StepOutput("r", 7, -1.0, 3, 9, "length")]) == ([], [])


def test_offline_step_ends_a_stopped_sequence_before_the_next_step(model_dir,
                                                                    free_run) -> None:
    _, text = free_run
    stop = text[len(text) // 2:len(text) // 2 + 2]
    engine = make_engine(model_dir, "continuous")
    engine.add_request("s", PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                   stop=(stop,)))
    events = []
    while not (events and events[-1].finished):
        events += engine.step()
    assert "".join(e.text for e in events) == text[:text.index(stop)]
    assert events[-1].finish_reason == "stop_sequence"
    assert not engine.has_unfinished()  # freed in the step that found the stop, not later
    assert engine.scheduler.allocator.num_used_blocks == 0


def test_served_detokenizes_on_the_output_thread_and_equals_offline(model_dir, free_run,
                                                                   monkeypatch) -> None:
    _, text = free_run
    stop = text[len(text) // 2:len(text) // 2 + 2]
    engine = make_engine(model_dir, "continuous")
    threads: dict[str, set[str]] = {"core": set(), "text": set()}
    core = engine.step_outputs

    def spy(record, real):
        def call(*args):
            threads[record].add(threading.current_thread().name)
            return real(*args)
        return call

    client = EngineClient(engine, max_queued=4)
    processor = client._loop.output_processor
    monkeypatch.setattr(engine, "step_outputs", spy("core", core))
    monkeypatch.setattr(processor, "process", spy("text", processor.process))
    client.start()
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop=(stop,))
        stopped, free = client.submit_all([GenerationRequest(PROMPT, params),
                                           GenerationRequest(PROMPT, greedy(NEW_TOKENS))])
        stopped_events, free_events = list(stopped.events()), list(free.events())
        assert "".join(e.text for e in stopped_events) == text[:text.index(stop)]
        assert stopped_events[-1].finish_reason == "stop_sequence"
        assert "".join(e.text for e in free_events) == text
        assert threads == {"core": {"engine-loop"}, "text": {"engine-output"}}
        wait_until(lambda: client.gauges().kv_blocks_used == 0 and not engine.has_unfinished())
    finally:
        client.shutdown(grace_seconds=0)


def test_a_failing_output_stage_fails_its_requests_and_serving_goes_on(model_dir,
                                                                        monkeypatch) -> None:
    engine = make_engine(model_dir, "continuous")
    client = EngineClient(engine, max_queued=4)
    real, calls = client._loop.output_processor.process, []

    def fail_first(outputs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(outputs)

    monkeypatch.setattr(client._loop.output_processor, "process", fail_first)
    client.start()
    try:
        failed = list(client.submit(GenerationRequest(PROMPT, greedy(6))).events())
        assert failed[-1].finish_reason == "error"
        assert failed[-1].error == "output processing failed"  # no internals
        ok = list(client.submit(GenerationRequest(PROMPT, greedy(6))).events())
        assert ok[-1].finish_reason == "length" and ok[-1].num_output_tokens == 6
        wait_until(lambda: client.gauges().kv_blocks_used == 0 and not engine.has_unfinished())
    finally:
        client.shutdown(grace_seconds=0)

