"""handler/http/metrics.py: its bulk histogram update against prometheus_client's own observe(),
and what a request and a step record."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from engine.outputs import StepStats
from handler.http.metrics import _LATENCY_BUCKETS, Metrics, observe_all

# On, below and between the bounds, zero, and past the last finite bound (+Inf's bucket)
AMOUNTS = [0.0, 0.005, 0.0050001, 0.004999, 0.01, 0.3, 1.0, 160.0, 160.5, 1e6, 0.02, 0.02]


def _histogram() -> tuple[Histogram, CollectorRegistry]:
    registry = CollectorRegistry()
    return Histogram("gap", "gap", buckets=_LATENCY_BUCKETS, registry=registry), registry


def _samples(registry: CollectorRegistry) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in registry.collect() for s in metric.samples
            if not s.name.endswith("_created")}


def test_observe_all_counts_every_bucket_as_observe_does() -> None:
    one_by_one, one_registry = _histogram()
    for amount in AMOUNTS:
        one_by_one.observe(amount)
    at_once, bulk_registry = _histogram()
    observe_all(at_once, AMOUNTS)
    observe_all(at_once, [])  # nothing to add
    expected, got = _samples(one_registry), _samples(bulk_registry)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if key[0] == "gap_sum":  # added once rather than value by value
            assert got[key] == pytest.approx(value, rel=1e-12)
        else:
            assert got[key] == value, key
    assert got[("gap_count", ())] == len(AMOUNTS)


def test_observe_all_falls_back_to_observe_without_prometheus_layout() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, amount: float) -> None:
            self.seen.append(amount)

    recorder = Recorder()
    observe_all(recorder, AMOUNTS)  # type: ignore[arg-type]
    assert recorder.seen == AMOUNTS


def test_a_request_observes_each_gap_between_its_tokens() -> None:
    metrics = Metrics()
    times = [10.0, 10.004, 10.01, 10.5, 12.0]
    metrics.on_request(200, 7, times, start=9.9, end=12.1)
    text = generate_latest(metrics.registry).decode()
    itl = "batchyard_inter_token_latency_seconds"
    assert f'{itl}_bucket{{le="0.005"}} 1.0' in text
    assert f'{itl}_bucket{{le="0.01"}} 2.0' in text
    assert f'{itl}_bucket{{le="0.25"}} 2.0' in text
    assert f'{itl}_bucket{{le="0.5"}} 3.0' in text  # 0.49
    assert f'{itl}_bucket{{le="2.5"}} 4.0' in text
    assert f"{itl}_count 4.0" in text
    assert "batchyard_generation_tokens_total 5.0" in text


def test_a_step_observes_its_tokens_prefill_and_decode_together() -> None:
    metrics = Metrics()
    for prefill, decode in ((0, 32), (24, 32), (48, 31), (512, 0)):
        metrics.on_step(StepStats(32, prefill, decode, 0, 32, 64, 512, 0, 0.003))
    text = generate_latest(metrics.registry).decode()
    steps = "batchyard_iteration_tokens"
    assert f'{steps}_bucket{{le="32.0"}} 1.0' in text
    assert f'{steps}_bucket{{le="64.0"}} 2.0' in text  # 56 tokens
    assert f'{steps}_bucket{{le="96.0"}} 3.0' in text  # 79: past a 64-row graph
    assert f'{steps}_bucket{{le="512.0"}} 4.0' in text
    assert f"{steps}_sum 679.0" in text


def test_steps_that_replayed_a_graph_are_counted() -> None:
    metrics = Metrics()
    for graph in (True, False, True):
        metrics.on_step(StepStats(4, 0, 4, 0, 4, 8, 64, 0, 0.002, graph=graph))
    text = generate_latest(metrics.registry).decode()
    assert "batchyard_graph_steps_total 2.0" in text
    assert "batchyard_step_seconds_count 3.0" in text
