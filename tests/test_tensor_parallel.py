"""Tensor parallelism over gloo with CPU processes: greedy output equals transformers `generate`
(so TP=1) token for token in every strategy, with replicated KV heads, a padded vocabulary and
preemption; a dead worker rank fails in-flight requests, turns /ping 503 and leaves nothing
behind. The sharding arithmetic is checked on its own."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineClient, EngineConfig, EngineDeadError, GenerationRequest
from engine.parallel.shard import Shard
from engine.runner.tp_workers import WorkerGroup, WorkerLost
from handler.config.serving_config import ServingConfig
from handler.http.app import create_app
from handler.http.state import ServerState
from tests.engine_harness import (
    MAX_MODEL_LEN,
    Req,
    drive,
    greedy,
    hf_greedy,
    make_engine,
    wait_until,
)
from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

NEW_TOKENS = [12, 3, 16, 7]


def reference(path):
    """(prompts, transformers' greedy continuations) for a tiny model."""
    rng = random.Random(3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)]
               for n in (1, 17, 33, 9)]
    return prompts, [hf_greedy(model, p, n) for p, n in zip(prompts, NEW_TOKENS, strict=True)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """4 q heads, 2 KV heads, vocabulary 320."""
    path = build_tiny_model(tmp_path_factory.mktemp("tp-llama"))
    return path, *reference(path)


def run_staggered(path, prompts, batching: str, tp: int, **overrides):
    reqs = [Req(f"r{i}", p, greedy(n), arrive)
            for i, (p, n, arrive) in enumerate(zip(prompts, NEW_TOKENS, [0, 0, 2, 5], strict=True))]
    engine = make_engine(path, batching, tensor_parallel_size=tp, **overrides)
    try:
        drive(engine, reqs)
        return [r.tokens for r in reqs], engine.scheduler.num_preemptions
    finally:
        engine.close()


@pytest.mark.parametrize("batching", ["none", "dynamic", "continuous", "paged"])
def test_two_ranks_reproduce_transformers_in_every_strategy(llama, batching) -> None:
    path, prompts, refs = llama
    tokens, _ = run_staggered(path, prompts, batching, tp=2)
    assert tokens == refs


def test_four_ranks_replicate_kv_heads_and_survive_preemption(llama, capfd, caplog) -> None:
    """2 KV heads over 4 ranks: each KV head lives on two ranks. A pool of 16 blocks of 4
    tokens cannot hold the four requests (26 blocks) at once, so the paged scheduler preempts.
    Each worker rank freezes its start-up heap, as a full collection would stall the ranks."""
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    path, prompts, refs = llama
    tokens, preemptions = run_staggered(path, prompts, "paged", tp=4, num_kv_blocks=16,
                                        block_size=4)
    assert tokens == refs
    assert preemptions > 0
    log = capfd.readouterr().err.splitlines()
    assert sum("tp-rank-" in line and "start-up heap frozen" in line for line in log) == 3


def test_two_ranks_through_the_padded_decode_path(llama) -> None:
    """The CUDA graphs' padded buckets and static buffers (run without graphs on CPU) on every
    rank, checked at start-up on each: the same tokens, and decode steps did take that path."""
    path, prompts, refs = llama
    reqs = [Req(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, NEW_TOKENS,
                                                                         strict=True))]
    engine = make_engine(path, "paged", tensor_parallel_size=2, padded_decode_on_cpu=True)
    try:
        drive(engine, reqs)
        assert engine.runner.padded_decode.steps > 0
    finally:
        engine.close()
    assert [r.tokens for r in reqs] == refs


def test_tied_embeddings_and_a_vocabulary_that_does_not_split_evenly(tmp_path) -> None:
    """One KV head (replicated on both ranks), a tied LM head, llama3 RoPE and 321 token ids:
    the second rank's vocabulary slice has a padding row that must never be sampled."""
    path = build_tiny_model(tmp_path, arch="llama_tied_llama3", vocab_size=321)
    prompts, refs = reference(path)
    tokens, _ = run_staggered(path, prompts, "continuous", tp=2)
    assert tokens == refs


def test_a_degree_the_model_does_not_split_by_is_refused(llama) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=3: the model's 4 attention "
                                         r"heads, .*intermediate_size 128 do not split"):
        make_engine(llama[0], "paged", tensor_parallel_size=3)


def config(path, tp: int, **overrides) -> EngineConfig:
    return EngineConfig(model=str(path), batching="paged", max_num_seqs=4, dtype="float32",
                        device="cpu", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=tp,
                        **overrides)


def worker_pids(state: ServerState) -> list[int]:
    core = psutil.Process(state.engine._loop._core._process.pid)
    return [p.pid for p in core.children() if "engine.core.tp_worker" in " ".join(p.cmdline())]


def serve(path, tp: int, **overrides) -> tuple[ServerState, object]:
    state = ServerState(ServingConfig(engine=config(path, tp, **overrides)))
    state.serve(EngineClient.from_config(state.config.engine, 8, process=True))
    return state, create_app(state).test_client()


def test_served_streams_match_and_a_dead_idle_worker_turns_ping_503(llama) -> None:
    """Through the engine core process: streamed tokens and text equal one rank's; then a
    worker rank killed while idle turns /ping 503 within seconds and refuses new work."""
    path, prompts, refs = llama
    state, app = serve(path, 2)
    try:
        assert app.get("/ping").status_code == 200
        handles = state.engine.submit_all([GenerationRequest(tuple(p), greedy(n))
                                           for p, n in zip(prompts, NEW_TOKENS, strict=True)])
        streams = [list(h.events()) for h in handles]
        assert [[e.token_id for e in s if e.token_id is not None] for s in streams] == refs
        assert all(s[-1].finish_reason == "length" for s in streams)
        (pid,) = worker_pids(state)
        psutil.Process(pid).send_signal(signal.SIGKILL)
        wait_until(lambda: app.get("/ping").status_code == 503, timeout=10)
        with pytest.raises(EngineDeadError):
            state.engine.submit(GenerationRequest(tuple(prompts[0]), greedy(3)))
    finally:
        state.shutdown(grace_seconds=0)


def test_a_worker_killed_mid_request_ends_it_with_an_error_and_nothing_hangs(llama) -> None:
    path, prompts, _ = llama
    state, app = serve(path, 2)
    core = state.engine._loop._core._process
    try:
        (pid,) = worker_pids(state)
        handle = state.engine.submit(GenerationRequest(tuple(prompts[0]), greedy(90)))
        events = handle.events()
        next(events)  # 89 tokens to go: many steps, each waiting on the worker's all-reduces
        psutil.Process(pid).send_signal(signal.SIGKILL)
        last = list(events)[-1]  # ends, never hangs
        assert last.finish_reason == "error" and "tensor-parallel" in last.error
        wait_until(lambda: app.get("/ping").status_code == 503, timeout=10)
        core.join(10)
        assert not core.is_alive()  # rank 0 exits with its worker gone
    finally:
        state.shutdown(grace_seconds=0)


def test_a_hung_worker_is_given_up_after_the_collective_timeout(llama) -> None:
    """A stopped (not dead) worker: rank 0 waits in an all-reduce until the timeout, then ends
    the request with an error and stops; the stopped worker is killed, not left behind."""
    path, prompts, _ = llama
    state, app = serve(path, 2, collective_timeout_s=3.0)
    try:
        (pid,) = worker_pids(state)
        handle = state.engine.submit(GenerationRequest(tuple(prompts[0]), greedy(90)))
        events = handle.events()
        next(events)
        worker = psutil.Process(pid)
        worker.send_signal(signal.SIGSTOP)
        last = list(events)[-1]
        assert last.finish_reason == "error" and "tensor-parallel" in last.error
        wait_until(lambda: app.get("/ping").status_code == 503, timeout=10)
        wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE,
                   timeout=10)
    finally:
        state.shutdown(grace_seconds=0)


def test_the_server_exits_when_a_rank_dies_so_the_platform_replaces_it(llama, tmp_path) -> None:
    """Through gunicorn: a worker rank killed while serving turns /ping 503 and the server
    process exits (non-zero), the way a model that fails to load does."""
    path, _, _ = llama
    properties = ("option.rolling_batch=paged\noption.max_rolling_batch_size=4\n"
                  f"option.max_model_len={MAX_MODEL_LEN}\noption.tensor_parallel_degree=2\n")
    with running_server(tmp_path, path, properties) as server:
        gunicorn = psutil.Process(server.process.pid)
        (worker,) = [p for p in gunicorn.children(recursive=True)
                     if "engine.core.tp_worker" in " ".join(p.cmdline())]
        worker.send_signal(signal.SIGKILL)
        assert server.process.wait(timeout=30) != 0
        assert "the engine stopped while serving" in server.log()


@pytest.mark.parametrize("stage", ["joining", "loaded"])
def test_a_worker_that_dies_while_starting_fails_the_start_at_once(llama, monkeypatch,
                                                                   stage) -> None:
    """A worker rank killed before it joins the ranks (rank 0 would wait in the rendezvous) or
    while it loads its shard (rank 0 would wait in its first collective): the engine's start
    fails within seconds with WorkerLost, not after the 30-minute start-up timeout, and leaves
    no process behind."""
    path, _, _ = llama
    wait_for = WorkerGroup.wait_for

    def killed_first(self, waited: str, timeout: float) -> None:
        if waited == stage:
            self._procs[0].kill()
        wait_for(self, waited, timeout)

    monkeypatch.setattr(WorkerGroup, "wait_for", killed_first)
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            make_engine(path, "paged", tensor_parallel_size=2).close()
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - the test reads what it was
            outcome.append(err)

    starter = threading.Thread(target=start, daemon=True)  # a hang must not hang the suite
    starter.start()
    starter.join(timeout=60)
    assert outcome, f"the start still waits for the dead worker ({stage})"
    assert isinstance(outcome[0], WorkerLost), outcome[0]
    assert "rank 1 exited" in str(outcome[0])
    assert not [p for p in psutil.Process().children(recursive=True)
                if "engine.core.tp_worker" in " ".join(p.cmdline())]


def test_reports_read_together_are_each_taken_at_their_stage() -> None:
    """A worker fast enough to report 'joining' and 'loaded' before rank 0 reads either: the
    second stage is taken from what the first read brought, not waited for on the pipe."""
    alive = type("Alive", (), {"poll": lambda self: None, "wait": lambda self, timeout: None})()
    group = WorkerGroup.__new__(WorkerGroup)  # the reports' side alone: no processes
    status, theirs = os.pipe()
    group.size, group._status, group._reports, group._procs = 2, [status], {}, [alive]
    os.write(theirs, b"joining\nloaded\n")
    group.wait_for("joining", 5.0)
    group.wait_for("loaded", 0.5)  # within the half second: read already
    os.close(theirs)
    with pytest.raises(WorkerLost, match="reported ''"):  # EOF from a live process
        group.wait_for("ready", 5.0)
    os.close(status)


def test_shards_split_heads_kv_heads_and_vocabulary() -> None:
    halves = [Shard(r, 2) for r in range(2)]
    assert [s.split(8) for s in halves] == [range(0, 4), range(4, 8)]
    assert [s.kv_heads(8, 4) for s in halves] == [range(0, 2), range(2, 4)]
    # fewer KV heads than ranks: each rank keeps the head its q heads read
    assert [Shard(r, 4).kv_heads(8, 2) for r in range(4)] == [range(0, 1), range(0, 1),
                                                               range(1, 2), range(1, 2)]
    assert [s.vocab(321) for s in halves] == [range(0, 161), range(161, 321)]
    assert halves[0].vocab_rows(321) == 161
    with pytest.raises(ValueError, match="3 KV heads"):
        Shard(0, 2).check(num_heads=6, num_kv_heads=3, intermediate_size=8)


def test_qwen3_q_and_k_norms_are_kept_whole_on_every_rank(tmp_path) -> None:
    """Qwen3's per-head norms are the same on every rank; its heads split like Llama's."""
    path = build_tiny_model(tmp_path, arch="qwen3")
    prompts, refs = reference(path)
    tokens, _ = run_staggered(path, prompts, "paged", tp=2)
    assert tokens == refs


@pytest.mark.parametrize("arch", ["phi3", "phi3_longrope", "mixtral", "qwen2_moe", "qwen3_moe",
                                  "gemma3"])
def test_fused_and_expert_checkpoint_tensors_are_sliced_per_rank(tmp_path, arch) -> None:
    """Phi-3 stores q/k/v and gate/up as one tensor each: every rank reads its heads' rows of
    q, k and v and its share of gate and up out of them (LongRoPE crossing included). MoE
    models: every rank routes every token and holds each expert's share of its rows."""
    path = build_tiny_model(tmp_path, arch=arch)
    prompts, refs = reference(path)
    tokens, _ = run_staggered(path, prompts, "paged", tp=2)
    assert tokens == refs
