"""The engine loop thread: submit / stream / abort, deadlines, failures, queue cap, shutdown;
and /ping following the loop's life."""

from __future__ import annotations

import dataclasses
import queue
import time
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from engine import (
    EngineClient,
    EngineDeadError,
    GenerationRequest,
    LLMEngine,
    QueueFullError,
    RequestError,
    SamplingParams,
)
from engine.core.engine_core import CoreUpdate, EngineCore
from engine.guided import GuidedDecoding
from engine.inputs import AbortRequest, AddRequest, StopCore
from engine.outputs import Gauges, StepStats
from engine.serving.loop import EngineLoop, RequestHandle
from engine.text.output_processor import StepOutput
from handler.config.serving_config import ServingConfig
from handler.http.app import create_app
from handler.http.state import ServerState
from tests.engine_harness import greedy, make_engine, wait_until
from tests.models_fixtures import build_tiny_model

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("loop-model"))


@pytest.fixture
def engine(model_dir) -> LLMEngine:
    return make_engine(model_dir, "continuous")


@pytest.fixture
def served(engine) -> EngineClient:
    client = EngineClient(engine, max_queued=2)
    client.start()
    yield client
    client.shutdown(grace_seconds=0)


def request(params: SamplingParams, deadline: float | None = None) -> GenerationRequest:
    return GenerationRequest(tuple(PROMPT), params, deadline)


def collect(handle) -> list:
    return list(handle.events())


def kv_used(client: EngineClient) -> int:
    return client.gauges().kv_blocks_used



def test_a_client_never_started_still_shuts_down_its_core(model_dir) -> None:
    client = EngineClient(make_engine(model_dir, "paged"), max_queued=4)
    client.shutdown(grace_seconds=0)  # raised "cannot join thread before it is started"
    assert not client.gauges().alive and not client.is_alive()


def test_serving_starts_once_the_guided_tokenizer_is_built(model_dir, monkeypatch) -> None:
    """llguidance's tokenizer build holds the GIL for up to ~0.3 s at a stretch: left running
    beside the first requests, it stalled their steps (a 49k vocabulary: ~0.45 s in all)."""
    build = GuidedDecoding._build

    def slow_build(self) -> None:
        time.sleep(0.3)
        build(self)
    monkeypatch.setattr(GuidedDecoding, "_build", slow_build)
    engine = make_engine(model_dir, "paged")
    client = EngineClient(engine, max_queued=4)
    assert not engine.guided.is_built  # still building in the background
    client.start()
    try:
        assert engine.guided.is_built
    finally:
        client.shutdown(grace_seconds=0)


def test_submitted_requests_stream_every_token_and_end(served) -> None:
    handles = [served.submit(request(greedy(n))) for n in (3, 9, 1)]
    runs = [collect(h) for h in handles]
    assert [sum(e.token_id is not None for e in run) for run in runs] == [3, 9, 1]
    assert all(run[-1].finish_reason == "length" and not run[-1].error for run in runs)
    wait_until(lambda: kv_used(served) == 0 and served.gauges().num_in_flight == 0)


def test_a_whole_answer_reader_is_woken_once_with_every_event_and_its_time(served,
                                                                          monkeypatch) -> None:
    """all_events() (non-streaming requests) waits for the final event alone: no blocking
    get per token, the same events as events() and the monotonic time each was delivered."""
    waits = []

    class Counted(queue.SimpleQueue):  # a handle's event queue that counts blocking reads
        def get(self, block=True, timeout=None):
            waits.append(timeout)
            return super().get(block, timeout)

    monkeypatch.setattr("engine.serving.loop.queue.SimpleQueue", Counted)
    streamed = collect(served.submit(request(greedy(9))))
    assert len(waits) >= len(streamed)  # events(): a blocking read per event
    waits.clear()
    started = time.monotonic()
    handle = served.submit(request(greedy(9)))
    answer = handle.all_events()
    assert not waits  # only get_nowait, once the end has come
    events, times = [e for e, _ in answer], [t for _, t in answer]
    assert [e.token_id for e in events] == [e.token_id for e in streamed]
    assert events[-1].finish_reason == "length"
    assert started <= times[0] and times == sorted(times) and times[-1] <= time.monotonic()


def test_a_whole_answer_reader_ends_a_request_whose_client_left(served) -> None:
    handle = served.submit(request(greedy(90)))
    handle.cancel_when(lambda: True)
    answer = handle.all_events()
    assert answer[-1][0].finish_reason == "abort" and handle.cancelled
    wait_until(lambda: kv_used(served) == 0)


def test_abort_ends_a_running_request_and_frees_its_kv(served) -> None:
    handle = served.submit(request(greedy(80)))
    events = handle.events()
    next(events)
    handle.abort()
    rest = list(events)
    assert rest[-1].finish_reason == "abort"
    wait_until(lambda: kv_used(served) == 0)


def test_deadline_passed_ends_with_timeout_and_frees_kv(served) -> None:
    handle = served.submit(request(greedy(90), deadline=time.monotonic() - 1))
    assert collect(handle)[-1].finish_reason == "timeout"
    wait_until(lambda: kv_used(served) == 0)


def test_capacity_is_running_plus_job_queue(served) -> None:
    """max_num_seqs (4) + job_queue_size (2) in flight; the 7th is refused at once."""
    handles = [served.submit(request(greedy(90))) for _ in range(6)]
    with pytest.raises(QueueFullError, match="capacity is 6"):
        served.submit(request(greedy(90)))
    for handle in handles:
        handle.abort()
    assert all(collect(h)[-1].finished for h in handles)


def test_a_failing_step_fails_its_batch_then_the_loop_serves_again(engine, served,
                                                                   monkeypatch) -> None:
    runner = engine.runner
    real_launch = runner.launch
    calls = {"n": 0}

    def fail_once(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real_launch(batch)

    monkeypatch.setattr(runner, "launch", fail_once)
    failed = collect(served.submit(request(greedy(5))))
    assert failed[-1].finish_reason == "error" and "engine failure" in failed[-1].error
    ok = collect(served.submit(request(greedy(5))))
    assert ok[-1].finish_reason == "length"
    wait_until(lambda: kv_used(served) == 0)


def test_repeated_failures_stop_the_loop_and_ping_turns_503(model_dir, monkeypatch) -> None:
    engine = make_engine(model_dir, "continuous")
    config = ServingConfig(engine=engine.config)
    state = ServerState(config)
    state.serve(EngineClient(engine, 4))
    client = create_app(state).test_client()
    assert client.get("/ping").status_code == 200

    def broken(batch):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "launch", broken)
    handles = [state.engine.submit(request(greedy(5))) for _ in range(4)]
    for handle in handles:  # every accepted request ends, none hangs
        assert collect(handle)[-1].finish_reason == "error"
    for _ in range(3):  # three failing steps in a row: the device is gone, the loop stops
        try:
            handle = state.engine.submit(request(greedy(5)))
        except EngineDeadError:
            break
        assert collect(handle)[-1].finish_reason == "error"
    wait_until(lambda: not state.engine.gauges().alive)
    assert not state.engine.is_alive() and not state.ready()  # /ping's answer, from it
    ping = client.get("/ping")
    assert ping.status_code == 503 and ping.get_json()["code"] == 503
    with pytest.raises(EngineDeadError):
        state.engine.submit(request(greedy(5)))
    invoke = client.post("/invocations", json={"inputs": "hello"})
    assert invoke.status_code == 503


def test_shutdown_lets_running_requests_finish_within_grace(model_dir) -> None:
    client = EngineClient(make_engine(model_dir, "continuous"), max_queued=4)
    client.start()
    handle = client.submit(request(SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                  min_new_tokens=40)))
    client.shutdown(grace_seconds=30)
    events = collect(handle)
    assert events[-1].finish_reason == "length" and events[-1].num_output_tokens == 40
    with pytest.raises(EngineDeadError):
        client.submit(request(greedy(1)))


def test_submit_all_validates_every_request_and_queues_none_when_one_is_bad(served) -> None:
    empty = GenerationRequest((), greedy(3))
    with pytest.raises(RequestError, match="inputs must not be empty"):
        served.submit_all([request(greedy(3)), empty])
    assert served.gauges().num_in_flight == 0


def test_submit_all_queues_all_or_none_at_capacity(served) -> None:
    handles = served.submit_all([request(greedy(90)) for _ in range(5)])
    with pytest.raises(QueueFullError, match="capacity is 6"):
        served.submit_all([request(greedy(90)), request(greedy(90))])
    assert served.gauges().num_in_flight == 5
    for handle in handles:
        handle.abort()
    assert all(collect(h)[-1].finished for h in handles)


def test_gauges_show_a_request_gone_as_soon_as_its_last_event_arrives(served) -> None:
    """The loop publishes its snapshot before handing out events: no wait needed."""
    assert collect(served.submit(request(greedy(4))))[-1].finished
    gauges = served.gauges()
    assert (gauges.kv_blocks_used, gauges.num_running, gauges.num_in_flight) == (0, 0, 0)
    assert gauges.alive and gauges.kv_blocks_total > 0


def test_gauges_time_busy_steps_alone(model_dir) -> None:
    """The gauges carry what the core's busy steps cost per sequence (the HTTP threads' CPU
    priority is decided by it): the sums of the StepStats of every step that held
    busy_step_sequences sequences or more; a step of fewer, which costs more per sequence and
    leaves the host idle anyway, is left out."""
    engine = make_engine(model_dir, "continuous", max_num_seqs=2)
    assert engine.config.busy_step_sequences == 2  # max_num_seqs, under BUSY_STEP_SEQUENCES
    assert dataclasses.replace(engine.config, max_num_seqs=32).busy_step_sequences == 8
    steps: list[StepStats] = []
    client = EngineClient(engine, 4, steps.append)
    client.start()
    try:
        handles = [client.submit(request(greedy(n))) for n in (6, 12)]
        assert all(collect(h)[-1].finished for h in handles)
        gauges = client.gauges()
    finally:
        client.shutdown(grace_seconds=0)
    busy = [s for s in steps if s.num_seqs >= 2]
    assert busy and len(busy) < len(steps)  # the 12-token request's last steps ran alone
    assert gauges.busy_sequence_steps == sum(s.num_seqs for s in busy)
    assert gauges.busy_step_seconds == pytest.approx(sum(s.step_seconds for s in busy))
    assert gauges.busy_step_seconds > 0


class _CoreAhead:
    """A core that has run ahead of the output thread: its updates are all waiting."""

    def __init__(self, updates: list) -> None:
        self.initial_gauges = _gauges(0)
        self._updates = queue.SimpleQueue()
        for update in updates:
            self._updates.put(update)
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)

    def receive(self):
        return self._updates.get()

    def has_update(self) -> bool:
        return not self._updates.empty()

    def start(self) -> None: ...

    def is_alive(self) -> bool:
        return True


def _gauges(running: int) -> Gauges:
    return Gauges(True, running, 0, running, running, 8, 16, 4, 0.0)


def _step(request_id: str, n: int, last: bool = False) -> CoreUpdate:
    out = StepOutput(request_id, 100 + n, -0.1, 3, n, "length" if last else None)
    stats = StepStats(1, 0, 1, 0, 1, 1, 8, 0, 0.001)
    return CoreUpdate([out], _gauges(0 if last else 1), stats)


def test_an_output_thread_behind_the_core_delivers_every_waiting_step_at_once(model_dir) -> None:
    """Steps already waiting reach each request together (one listener call: one write per
    stream), in order, each step's facts still reported; the gauges are the newest."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    core = _CoreAhead([_step("a-0", 1), _step("a-0", 2), _step("a-0", 3, last=True), None])
    steps: list[StepStats] = []
    loop = EngineLoop(core, tokenizer, 4, 4, on_step=steps.append, id_prefix="a-")
    handle = loop.submit([request(SamplingParams(max_new_tokens=3))])[0]
    calls: list[int] = []
    handle.on_delivery(lambda: calls.append(handle._events.qsize()))
    loop.start()
    events = collect(handle)
    assert [e.token_id for e in events] == [101, 102, 103] and events[-1].finished
    assert calls == [3]  # the three steps in one delivery
    assert len(steps) == 3 and loop.gauges().num_running == 0


def test_streams_that_start_or_end_in_a_delivery_are_written_first(model_dir) -> None:
    """A client waits on its first token and on its end (a closed loop sends the next request
    then); a token mid-stream can go out a few sends later. Those requests are detokenized and
    their listeners run first; every listener still runs once, each request's events in order."""
    core = SimpleNamespace(initial_gauges=None, send=lambda message: None)
    loop = EngineLoop(core, AutoTokenizer.from_pretrained(model_dir), 8, 8)
    called: list[tuple[str, int]] = []
    handles: dict[str, RequestHandle] = {}
    for rid in ("mid", "first", "last", "mid2"):
        handles[rid] = RequestHandle(loop, rid, 3)
        loop._handles[rid] = handles[rid]
        loop.output_processor.add(rid, SamplingParams(max_new_tokens=16))
        # with how many events the last request waits as each listener runs
        handles[rid].on_delivery(lambda rid=rid: called.append((rid, mid_queue.qsize())))
    mid_queue = handles["mid"]._events

    def out(rid: str, n: int, finished: bool = False) -> StepOutput:
        return StepOutput(rid, 100 + n, -0.1, 3, n, "length" if finished else None)

    loop._deliver([out("mid", 5), out("first", 1), out("mid", 6), out("last", 9, True),
                   out("mid2", 2), out("first", 2)])
    # the first and last streams' lines went out before "mid"'s tokens were even detokenized
    assert called == [("first", 0), ("last", 0), ("mid", 2), ("mid2", 2)]
    queued = {rid: [handle._events.get_nowait().num_output_tokens
                    for _ in range(handle._events.qsize())] for rid, handle in handles.items()}
    assert queued == {"mid": [5, 6], "first": [1, 2], "last": [9], "mid2": [2]}


def _run_core(engine: LLMEngine, inbox: list[list],
              when_idle: bool = True) -> list[CoreUpdate | None]:
    """EngineCore over a scripted inbox: the next list of messages at each receive (with
    `when_idle`, only once no request is left unfinished; none while it has work), then
    StopCore. Every update it publishes, in order."""
    script, published = iter(inbox), []

    def receive(timeout: float | None) -> list:
        return [] if when_idle and engine.has_unfinished() else next(script, [StopCore()])
    EngineCore(engine, receive, published.append).run()
    return published


def test_the_core_publishes_one_update_per_step_not_one_more_per_arrival(engine) -> None:
    """Arrivals ride on the next step's update (its gauges count them); a core with nothing
    to run still publishes what an abort changed, once."""
    updates = _run_core(engine, [[AddRequest("a", request(greedy(3)))], [AbortRequest("gone")]])
    assert [u.stats is not None for u in updates[:4]] == [True, True, True, False]
    assert [len(u.outputs) for u in updates[:4]] == [1, 1, 1, 0]
    assert updates[0].gauges.num_running == 1 and updates[3].gauges.num_running == 0
    assert len(updates) == 5 and updates[-1] is None  # the stop itself publishes nothing more


def test_a_core_that_cannot_step_yet_still_shows_the_arrival_in_its_gauges(model_dir) -> None:
    waiting = make_engine(model_dir, "dynamic", max_batch_delay_ms=60_000.0)
    published = _run_core(waiting, [[AddRequest("a", request(greedy(3)))]], when_idle=False)
    first, *_, last_error, end = published
    assert first.stats is None and first.outputs == [] and first.gauges.num_waiting == 1
    assert last_error.outputs[0].finish_reason is not None and end is None  # stopped
