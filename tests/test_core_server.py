"""One engine core shared by several serving processes (option.api_server_count): each front
gets the same tokens as a core of its own, only its own events, and a front that leaves (shut
down or died) takes only its own requests with it; the core stops when the last one is gone."""

from __future__ import annotations

import logging
import threading

import pytest

from engine import EngineClient, EngineConfig, GenerationRequest, SamplingParams
from engine.core.server import CoreServer
from tests.engine_harness import MAX_MODEL_LEN, Req, drive, greedy, make_engine, wait_until
from tests.models_fixtures import build_tiny_model

PROMPTS = [(5, 6, 7, 8), (9, 10, 11), tuple(range(20, 40)), (3, 4)]
LONG = SamplingParams(max_new_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("core-server-model"))


def config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), batching="paged", max_num_seqs=4,
                        dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def core(model_dir):
    server = CoreServer(config(model_dir))
    server.wait_listening()
    yield server
    server.stop()


def front(core: CoreServer, model_dir, max_queued: int = 8) -> EngineClient:
    client = EngineClient.connect(config(model_dir), core.address.path, core.address.authkey,
                                  max_queued=max_queued)
    client.start()
    return client


def params() -> list[SamplingParams]:
    return [greedy(12), greedy(5), SamplingParams(max_new_tokens=9, do_sample=True, seed=7,
                                                  top_k=20, ignore_eos=True), greedy(7)]


def tokens(client: EngineClient, prompts, each: list[SamplingParams]) -> list[list[int]]:
    handles = client.submit_all([GenerationRequest(p, sp)
                                 for p, sp in zip(prompts, each, strict=True)])
    return [[e.token_id for e in handle.events() if e.token_id is not None]
            for handle in handles]


def test_two_fronts_get_their_own_tokens_as_from_a_core_of_their_own(core, model_dir) -> None:
    alone = EngineClient(make_engine(model_dir, "paged"), max_queued=8)
    alone.start()
    try:
        expected = tokens(alone, PROMPTS, params())
    finally:
        alone.shutdown(grace_seconds=0)
    fronts = [front(core, model_dir), front(core, model_dir)]
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(
        i, [tokens(fronts[i], PROMPTS, params()) for _ in range(3)])) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got[0] == got[1] == [expected] * 3
    for client in fronts:
        wait_until(lambda c=client: c.gauges().kv_blocks_used == 0)
        assert client.gauges().num_in_flight == 0 and client.gauges().alive
        assert client.is_alive()
        client.shutdown(grace_seconds=0)


def test_a_front_that_dies_takes_only_its_own_requests(core, model_dir) -> None:
    survivor, doomed = front(core, model_dir), front(core, model_dir)
    before = tokens(survivor, PROMPTS, params())
    doomed.submit(GenerationRequest((5, 6, 7), LONG))
    running = survivor.submit(GenerationRequest((9, 10), LONG))
    wait_until(lambda: survivor.gauges().num_running == 2)
    doomed._loop._core.terminate()  # as if its process died: the core reads EOF
    wait_until(lambda: survivor.gauges().num_running == 1)  # the orphan was aborted
    events = list(running.events())
    assert events[-1].finish_reason == "length"
    assert sum(e.token_id is not None for e in events) == LONG.max_new_tokens
    assert tokens(survivor, PROMPTS, params()) == before
    wait_until(lambda: survivor.gauges().kv_blocks_used == 0)
    assert survivor.gauges().alive
    survivor.shutdown(grace_seconds=0)


def test_the_core_outlives_a_front_that_shuts_down_and_stops_with_the_last(core,
                                                                           model_dir) -> None:
    first, second = front(core, model_dir), front(core, model_dir)
    handle = second.submit(GenerationRequest((5, 6, 7), greedy(6)))
    first.shutdown(grace_seconds=0)
    assert not first.gauges().alive
    events = list(handle.events())
    assert events[-1].finish_reason == "length" and second.gauges().alive
    late = front(core, model_dir)  # a restarted worker connects to the running core
    assert tokens(late, PROMPTS[:1], params()[:1]) == tokens(second, PROMPTS[:1], params()[:1])
    late.shutdown(grace_seconds=0)
    second.shutdown(grace_seconds=0)
    core._process.wait(30)  # the last front left: the core process exits by itself
    assert core._process.returncode == 0


def test_a_model_that_fails_to_load_fails_every_front(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    server = CoreServer(EngineConfig(model=str(tmp_path), batching="paged", device="cpu"))
    server.wait_listening()
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            EngineClient.connect(EngineConfig(model=str(tmp_path), device="cpu"),
                                 server.address.path, server.address.authkey, max_queued=1)
    finally:
        server.stop()
    assert server._process.returncode == 1


def test_a_front_that_does_not_read_yet_does_not_block_the_core(core, model_dir) -> None:
    """A restarted worker connects, then loads its tokenizer before it reads: the core sends it
    nothing until it says it reads, or its socket would fill and block the core's every send
    (~2,000 steps here: several times the socket's buffer)."""
    loading = EngineClient.connect(config(model_dir), core.address.path, core.address.authkey,
                                   max_queued=8)  # not started: reads nothing
    busy = front(core, model_dir, max_queued=100)
    done: list = []
    worker = threading.Thread(target=lambda: done.append(tokens(
        busy, [(5, 6, 7, i) for i in range(100)], [greedy(80)] * 100)))
    worker.start()
    worker.join(180)
    assert done and all(len(t) == 80 for t in done[0])
    loading.start()  # now it reads, and its requests run as anyone's
    assert tokens(loading, PROMPTS[:1], params()[:1]) == tokens(busy, PROMPTS[:1], params()[:1])
    loading.shutdown(grace_seconds=0)
    busy.shutdown(grace_seconds=0)


def test_step_stats_count_each_preemption_once(model_dir) -> None:
    """/metrics adds StepStats.num_preemptions up, whichever process received the step."""
    engine = make_engine(model_dir, "paged", block_size=4, num_kv_blocks=26)
    reported: list[int] = []
    prompts = [list(range(4 + i, 30 + 3 * i)) for i in range(4)]
    drive(engine, [Req(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)],
          after_step=lambda e: reported.append(e.last_step_stats(0.0).num_preemptions))
    assert engine.scheduler.num_preemptions > 0
    assert sum(reported) == engine.scheduler.num_preemptions


def test_the_shared_core_freezes_its_start_up_heap_before_it_reports_ready(
        model_dir, capfd, caplog) -> None:
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    server = CoreServer(config(model_dir))
    try:
        server.wait_listening()
        client = front(server, model_dir)
        assert "start-up heap frozen" in capfd.readouterr().err
        client.shutdown(grace_seconds=0)
    finally:
        server.stop()
