"""StepWatch: a slow engine step is logged with its phases, full garbage collections and
torch.compile runs; ordinary steps are not; a served core reports a stalled step."""

from __future__ import annotations

import gc
import logging
import time

import pytest
import torch

from engine import EngineClient, GenerationRequest
from engine.observe.step_watch import WARN_FIRST, StepWatch
from engine.outputs import StepStats
from tests.engine_harness import greedy, make_engine
from tests.models_fixtures import build_tiny_model

LOGGER = "engine.observe.step_watch"


def stats(seconds: float) -> StepStats:
    return StepStats(num_seqs=9, num_prefill_tokens=230, num_decode_tokens=8, num_waiting=0,
                     num_running=9, kv_blocks_used=1, kv_blocks_total=8, num_preemptions=0,
                     step_seconds=seconds)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def watch():
    w = StepWatch()
    w.install()
    yield w
    w.uninstall()


def test_ordinary_steps_pass_and_set_the_usual_step(watch, caplog) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    for _ in range(100):
        watch.start()
        assert not watch.finish(stats(0.003))
    assert watch.usual_seconds == pytest.approx(0.003)
    watch.start()
    assert not watch.finish(stats(0.09))  # 30x the usual step, under the absolute floor
    assert warnings(caplog) == []


def test_slow_step_names_its_size_and_phases(watch, caplog) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    watch.finish(stats(0.003))
    watch.start()
    watch.phases.start()
    watch.phases.mark("schedule")
    time.sleep(0.02)
    watch.phases.mark("forward")
    assert watch.finish(stats(0.612))
    [message] = warnings(caplog)
    assert message.startswith("slow engine step: 612 ms, the usual step 3.0 ms (9 sequences: "
                              "230 prompt + 8 decode tokens); phases (ms): schedule 0.0, forward 2")
    assert message.endswith("full garbage collections: none; torch.compile runs: none; "
                            "engine thread at 100 ms: not sampled")


def test_a_step_slower_than_ten_usual_ones_is_slow_above_the_floor(caplog) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    watch = StepWatch()
    for _ in range(50):
        watch.finish(stats(0.05))
    assert not watch.finish(stats(0.45))
    assert watch.finish(stats(0.6))
    assert len(warnings(caplog)) == 1


def test_a_full_collection_inside_the_step_is_counted(watch, caplog) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    watch.start()
    gc.collect(0)  # the young generation: not counted
    gc.collect()
    assert watch.finish(stats(0.5))
    [message] = warnings(caplog)
    assert "full garbage collections: 1 (" in message
    watch.start()  # the next step starts from zero
    assert watch.finish(stats(0.5))
    assert "full garbage collections: none" in warnings(caplog)[-1]


def test_a_torch_compile_inside_the_step_is_counted(watch, caplog) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    uninstalled = StepWatch()
    uninstalled.install()
    uninstalled.uninstall()  # its hooks are gone: it must not count what follows

    def double(x):
        return x * 2

    compiled = torch.compile(double, backend="eager", dynamic=False)
    watch.start()
    compiled(torch.ones(3))
    compiled(torch.ones(3))  # the same shape: compiled once
    compiled(torch.ones(5))  # a new shape compiles again
    assert watch.finish(stats(0.5))
    [message] = warnings(caplog)
    assert "torch.compile runs: 2 (" in message and "not compiled at start-up" in message
    uninstalled.start()
    assert "torch.compile runs: none" in uninstalled.describe(stats(0.5))


def test_warnings_are_the_first_twenty_then_every_hundredth(caplog) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    watch = StepWatch()
    for _ in range(250):
        watch.finish(stats(1.0))
    logged = warnings(caplog)
    assert len(logged) == WARN_FIRST + 2
    assert "[slow step 200; after the first 20 every 100th is logged]" in logged[-1]


def test_a_served_core_reports_a_stalled_step(tmp_path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    engine = make_engine(build_tiny_model(tmp_path / "model"), "continuous")
    real_launch = engine.runner.launch
    calls = {"n": 0}

    def stall_the_third(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            time.sleep(0.3)
        return real_launch(batch)

    monkeypatch.setattr(engine.runner, "launch", stall_the_third)
    client = EngineClient(engine, max_queued=2)
    client.start()
    try:
        events = list(client.submit(GenerationRequest((5, 6, 7, 8), greedy(6))).events())
    finally:
        client.shutdown(grace_seconds=0)
    assert events[-1].finish_reason == "length"
    [message] = warnings(caplog)
    assert "(1 sequence: 0 prompt + 1 decode tokens)" in message
    phases = dict(part.rsplit(" ", 1) for part in
                  message.split("phases (ms): ")[1].split(";")[0].split(", "))
    assert float(phases["prepare"]) >= 250  # the stall was inside the runner's launch
    assert "engine thread at 100 ms: test_step_watch.py:" in message  # caught in the act:
    assert " stall_the_third < " in message.split("engine thread at 100 ms: ")[1]  # sleeping
