"""The engine core in its own process: same tokens as the core thread, aborts, deadlines and
stop strings across the pipes, and a dead core fails its requests and turns /ping 503."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import time
from multiprocessing.reduction import ForkingPickler

import pytest

from engine import (
    EngineClient,
    EngineConfig,
    EngineDeadError,
    GenerationRequest,
    RequestError,
    SamplingParams,
)
from engine.core.engine_core import CoreUpdate
from engine.core.process import Readiness
from engine.heap import freeze_start_up_heap
from engine.outputs import Gauges, StepStats
from engine.text.output_processor import StepOutput
from handler.config.serving_config import ServingConfig
from handler.http.app import create_app
from handler.http.state import ServerState
from tests.engine_harness import MAX_MODEL_LEN, greedy, make_engine, wait_until
from tests.models_fixtures import build_tiny_model

PROMPTS = [(5, 6, 7, 8), (9, 10, 11), tuple(range(20, 40))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("core-process-model"))


def config(model_dir, batching: str = "paged") -> EngineConfig:
    return EngineConfig(model=str(model_dir), batching=batching, max_num_seqs=4,
                        dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def in_process(model_dir):
    client = EngineClient.from_config(config(model_dir), max_queued=8, process=True)
    client.start()
    yield client
    client.shutdown(grace_seconds=0)



def test_freezing_the_start_up_heap_parks_every_live_object() -> None:
    gc.unfreeze()
    try:
        freeze_start_up_heap()
        assert gc.get_freeze_count() > 1000  # modules, torch, the test session
        assert gc.isenabled()  # what serving allocates is still collected
    finally:
        gc.unfreeze()


def test_the_core_process_freezes_its_start_up_heap_before_it_reports_ready(
        model_dir, capfd, caplog) -> None:
    """Otherwise each full collection while serving walks every start-up object on the engine
    thread (~180 ms on 2 vCPUs), a stall of every running request."""
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    client = EngineClient.from_config(config(model_dir), max_queued=8, process=True)
    try:
        err = capfd.readouterr().err
        assert "start-up heap frozen" in err
        # ... after the guided tokenizer's build, whose GIL would stall the first steps
        assert err.index("tokenizer view built") < err.index("start-up heap frozen")
    finally:
        client.shutdown(grace_seconds=0)  # never started: shutdown still stops the core
    assert not client.gauges().alive


def run_all(client: EngineClient, params: list[SamplingParams]) -> list[list]:
    handles = client.submit_all([GenerationRequest(p, sp)
                                 for p, sp in zip(PROMPTS, params, strict=True)])
    return [list(handle.events()) for handle in handles]


def test_the_core_process_streams_the_same_tokens_and_text_as_the_core_thread(
        model_dir, in_process) -> None:
    params = [greedy(12), greedy(5), SamplingParams(max_new_tokens=9, do_sample=True, seed=7,
                                                    top_k=20, ignore_eos=True)]
    thread = EngineClient(make_engine(model_dir, "paged"), max_queued=8)
    thread.start()
    try:
        expected = run_all(thread, params)
    finally:
        thread.shutdown(grace_seconds=0)
    got = run_all(in_process, params)
    assert [[e.token_id for e in run] for run in got] == [[e.token_id for e in run]
                                                          for run in expected]
    assert ["".join(e.text for e in run) for run in got] == ["".join(e.text for e in run)
                                                           for run in expected]
    assert [run[-1].finish_reason for run in got] == ["length"] * 3
    wait_until(lambda: in_process.gauges().kv_blocks_used == 0)
    assert in_process.gauges().num_in_flight == 0 and in_process.gauges().alive


def test_validation_abort_deadline_and_stop_cross_the_pipes(in_process) -> None:
    with pytest.raises(RequestError, match=f"<= {MAX_MODEL_LEN}"):
        in_process.submit(GenerationRequest((5,), greedy(MAX_MODEL_LEN)))
    long = in_process.submit(GenerationRequest(PROMPTS[0], greedy(80)))
    events = long.events()
    next(events)
    long.abort()
    assert list(events)[-1].finish_reason == "abort"
    # time.monotonic() is one clock for both processes: a passed deadline ends it there
    late = in_process.submit(GenerationRequest(PROMPTS[1], greedy(80), time.monotonic() - 1))
    timed_out = list(late.events())[-1]
    assert timed_out.finish_reason == "timeout" and "predict_timeout" in timed_out.error
    free = "".join(e.text for e in in_process.submit(
        GenerationRequest(PROMPTS[2], greedy(16))).events())
    stop = free[4:6]
    stopped = list(in_process.submit(GenerationRequest(PROMPTS[2], SamplingParams(
        max_new_tokens=16, ignore_eos=True, stop=(stop,)))).events())
    assert "".join(e.text for e in stopped) == free[:free.index(stop)]
    assert stopped[-1].finish_reason == "stop_sequence"
    wait_until(lambda: in_process.gauges().kv_blocks_used == 0)


def test_a_killed_core_fails_in_flight_requests_and_ping_turns_503(model_dir) -> None:
    state = ServerState(ServingConfig(engine=config(model_dir, "continuous")))
    state.serve(EngineClient.from_config(state.config.engine, 8, process=True))
    app = create_app(state).test_client()
    assert app.get("/ping").status_code == 200
    handle = state.engine.submit(GenerationRequest(PROMPTS[0], greedy(80)))
    events = handle.events()
    next(events)
    os.kill(state.engine._loop._core._process.pid, signal.SIGKILL)
    last = list(events)[-1]  # ends, never hangs
    assert last.finish_reason == "error" and last.error == "the engine loop stopped"
    wait_until(lambda: app.get("/ping").status_code == 503, timeout=5)
    with pytest.raises(EngineDeadError):
        state.engine.submit(GenerationRequest(PROMPTS[0], greedy(3)))
    state.shutdown(grace_seconds=0)


def test_a_core_that_cannot_load_fails_start_up_with_its_reason(model_dir, tmp_path) -> None:
    broken = tmp_path / "no-weights"
    shutil.copytree(model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(RuntimeError, match="engine core process did not start: .*safetensors"):
        EngineClient.from_config(config(broken), max_queued=1, process=True)
    assert {p.pid for p in multiprocessing.active_children()} <= before  # none left behind


@pytest.mark.parametrize("outputs, stats", [
    ([StepOutput("a", 7, -0.5, 4, 1), StepOutput("b", None, None, 3, 0, "abort", "gone"),
      StepOutput("c", 9, -1.25, 20, 5, "length", None, ((9, -1.25), (4, -2.0)))],
     StepStats(3, 20, 1, 0, 3, 5, 64, 0, 0.002, graph=True)),
    ([], None),
])
def test_a_core_update_crosses_the_pipe_as_it_was_sent(outputs, stats) -> None:
    """Pickled as columns (the core pickles one per step): the same outputs, typed as sent."""
    update = CoreUpdate(outputs, Gauges(True, 3, 1, 2, 5, 64, 16, 4, 0.5), stats)
    back = pickle.loads(ForkingPickler.dumps(update))
    assert back == update
    assert all(type(out) is StepOutput for out in back.outputs)


def test_readiness_names_the_connections_with_a_message_or_an_end() -> None:
    """The core's and the output thread's one poll object: a message, or a peer gone (read as
    EOF), is readable; an idle connection is not, and a wait for it times out."""
    idle_reader, idle_writer = multiprocessing.Pipe(duplex=False)
    busy_reader, busy_writer = multiprocessing.Pipe(duplex=False)
    gone_reader, gone_writer = multiprocessing.Pipe(duplex=False)
    ready = Readiness(idle_reader, busy_reader)
    assert ready.ready() == []
    start = time.monotonic()
    assert ready.ready(0.05) == []
    assert time.monotonic() - start >= 0.04
    busy_writer.send("hello")
    assert ready.ready() == [busy_reader]
    assert busy_reader.recv() == "hello"
    assert ready.ready() == []
    ready.add(gone_reader)
    gone_writer.close()
    assert ready.ready(1.0) == [gone_reader]
    with pytest.raises(EOFError):
        gone_reader.recv()
    ready.remove(gone_reader)
    gone_reader.close()
    assert ready.ready() == []
    for conn in (idle_reader, idle_writer, busy_reader, busy_writer):
        conn.close()
