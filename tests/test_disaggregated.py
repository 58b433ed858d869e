"""Disaggregated prefill and decode (engine/disagg/): a prompt's KV moves from a prefill
engine's pool to a decode engine's, and greedy output stays transformers' token for token."""

from __future__ import annotations

import queue
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineDeadError, SamplingParams
from engine.disagg.roles import Arrived, DecodeRole, PrefillRole
from engine.inputs import AddPrefilled, GenerationRequest, PrefillRequest
from tests.engine_harness import (
    Req,
    drive,
    hf_greedy,
    make_engine,
    prompts_sharing_a_prefix,
)
from tests.models_fixtures import build_tiny_model


class QueueWire:
    """KVLink's contract over in-process queues: (src, dst, tag) channels, in order."""

    def __init__(self, rank: int, channels: dict) -> None:
        self.rank = rank
        self.device = torch.device("cpu")
        self._channels = channels

    def _channel(self, src: int, dst: int, tag: int) -> queue.SimpleQueue:
        return self._channels.setdefault((src, dst, tag), queue.SimpleQueue())

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._channel(self.rank, dst, tag).put(tensor.clone())

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        self.send(tensor, dst, tag)
        return SentAlready()

    def recv(self, shape, dtype, src: int, tag: int) -> torch.Tensor:
        tensor = self._channel(src, self.rank, tag).get(timeout=30)
        assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype
        return tensor


class SentAlready:
    def wait(self) -> None:
        pass


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("disagg"))


@pytest.fixture(scope="module")
def hf(model):
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def prompts_for(seed: int, lengths=(9, 37, 4, 21, 30)) -> list[list[int]]:
    return prompts_sharing_a_prefix(seed, lengths, shared=16)


def serve_split(model, prompts, params, prefill: dict, decode: dict) -> list[list[int]]:
    """Each prompt prefilled by one engine and decoded by another, the KV moved between their
    pools through the roles (the router's part played here)."""
    channels: dict = {}
    p_engine = make_engine(model, "paged", **prefill)
    d_engine = make_engine(model, "paged", **decode)
    p_role = PrefillRole(p_engine, QueueWire(0, channels))
    d_role = DecodeRole(d_engine, QueueWire(1, channels), wake=lambda: None)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    requests = {f"r{i}": GenerationRequest(tuple(p), params) for i, p in enumerate(prompts)}
    arriving = list(requests.items())  # one every other step: later ones find cached blocks
    try:
        for step in range(2000):
            if arriving and step % 2 == 0:
                rid, request = arriving.pop(0)
                p_role.apply(PrefillRequest(rid, request, decode_rank=1), {})
            if not (arriving or p_engine.has_unfinished() or d_engine.has_unfinished()):
                break  # (hand-offs arrive within the iteration that makes them)
            outputs = p_engine.step_outputs()
            for handoff in p_role.after_step(outputs):
                d_role.apply(AddPrefilled(handoff.request_id, requests[handoff.request_id],
                                          handoff.token_id, handoff.seed,
                                          handoff.num_kv_tokens, handoff.src), {})
                d_role.apply(d_role.arrivals.get(timeout=30), {})
            for out in outputs + d_engine.step_outputs():
                if out.token_id is not None:
                    tokens[out.request_id].append(out.token_id)
            p_engine.scheduler.check_integrity()
            d_engine.scheduler.check_integrity()
        for engine in (p_engine, d_engine):
            allocator = engine.scheduler.allocator
            assert allocator.num_free_blocks == allocator.num_blocks, "KV leaked"
        serve_split.counts = {  # type: ignore[attr-defined]
            "decode_preemptions": d_engine.scheduler.num_preemptions,
            "prefill_hits": p_engine.scheduler.allocator.prefix_hits,
            "decode_hits": d_engine.scheduler.allocator.prefix_hits}
    finally:
        p_role.close()
        d_role.close()
        p_engine.close()
        d_engine.close()
    return [tokens[f"r{i}"] for i in range(len(prompts))]


CASES = {
    "plain": ({}, {}),
    "chunked-prefill": ({"max_num_batched_tokens": 8}, {}),
    "prefix-caching-both-sides": ({"enable_prefix_caching": True, "block_size": 4},
                                  {"enable_prefix_caching": True, "block_size": 4}),
    "decode-preempts": ({}, {"num_kv_blocks": 9, "block_size": 8}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_output_equals_transformers(model, hf, case) -> None:
    prompts = prompts_for(3)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prefill, decode = CASES[case]
    got = serve_split(model, prompts, params, prefill, decode)
    assert got == [hf_greedy(hf, p, 12) for p in prompts]
    counts = serve_split.counts  # type: ignore[attr-defined]
    if case == "decode-preempts":
        assert counts["decode_preemptions"] > 0
    if case == "prefix-caching-both-sides":
        assert counts["prefill_hits"] > 0 and counts["decode_hits"] > 0


def test_sampled_output_follows_the_seed_across_the_hand_off(model) -> None:
    prompts = prompts_for(5)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, seed=7,
                            do_sample=True, ignore_eos=True)
    split = serve_split(model, prompts, params, {}, {})
    whole = serve_whole(model, prompts, params)
    assert split == whole


def serve_whole(model, prompts, params) -> list[list[int]]:
    """The same requests on one colocated engine."""
    engine = make_engine(model, "paged")
    reqs = [Req(f"r{i}", p, params) for i, p in enumerate(prompts)]
    try:
        drive(engine, reqs)
    finally:
        engine.close()
    return [r.tokens for r in reqs]


def test_a_lost_transfer_recomputes_the_prompt_after_the_same_first_token(model, hf) -> None:
    prompts = prompts_for(9)[:2]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    p_engine = make_engine(model, "paged")
    d_engine = make_engine(model, "paged")
    d_role = DecodeRole(d_engine, QueueWire(1, {}), wake=lambda: None)
    try:
        for i, p in enumerate(prompts):
            p_engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=1, ignore_eos=True))
        firsts = {out.request_id: out.token_id for _ in range(10)
                  for out in p_engine.step_outputs() if out.token_id is not None}
        for i, p in enumerate(prompts):
            notice = AddPrefilled(f"r{i}", GenerationRequest(tuple(p), params),
                                  firsts[f"r{i}"], 0, len(p), 0)
            d_role.apply(Arrived(notice, None), {})
        tokens: dict[str, list[int]] = {rid: [t] for rid, t in firsts.items()}
        while d_engine.has_unfinished():
            tokens_of(d_engine.step_outputs(), tokens)
    finally:
        p_engine.close()
        d_engine.close()
    assert [tokens[f"r{i}"] for i in range(2)] == [hf_greedy(hf, p, 8) for p in prompts]


# --- worker processes behind the router, the KV over gloo (1 + 1: the HTTP and remote-worker
# tests below) ---

def start_client(model, max_model_len: int = 96, **disagg):
    from engine import Disaggregation, EngineClient, EngineConfig

    config = EngineConfig(model=str(model), batching="paged", max_num_seqs=4, dtype="float32",
                          device="cpu", max_model_len=max_model_len,
                          max_num_batched_tokens=16, disaggregation=Disaggregation(**disagg))
    client = EngineClient.from_config(config, 100)
    client.start()
    return client


# --- KV-Runahead: one prompt shared by several prefill workers ---

def test_the_partition_balances_attention_and_covers_the_prompt() -> None:
    from engine.disagg.partition import partition

    starts = partition(4000, 2, 3000.0)
    assert starts[0] == 0 and 2000 < starts[1] < 2400  # the later slice attends to more
    assert partition(5, 3, 10.0) == [0, 2, 4]  # uneven, every slice at least one token
    assert partition(3, 3, 0.0) == [0, 1, 2]
    assert partition(100, 4, 1e9) == [0, 25, 50, 75]  # no attention cost: equal slices


def serve_cooperative(model, prompts, params, num_prefill: int, **prefill) -> list[list[int]]:
    """Each prompt split across `num_prefill` prefill engines (stepped one after the other:
    the in-process wire holds what a layer sends until the next one reads it)."""
    from engine.disagg.partition import linear_tokens, partition
    from engine.inputs import CooperativeSlice
    from engine.model_files import read_json_object

    channels: dict = {}
    engines = [make_engine(model, "paged", **prefill) for _ in range(num_prefill)]
    d_engine = make_engine(model, "paged")
    roles = [PrefillRole(e, QueueWire(i, channels)) for i, e in enumerate(engines)]
    d_rank = num_prefill
    d_role = DecodeRole(d_engine, QueueWire(d_rank, channels), wake=lambda: None)
    r = linear_tokens(read_json_object(model / "config.json"))
    requests = {f"r{i}": GenerationRequest(tuple(p), params) for i, p in enumerate(prompts)}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    for coop_id, (rid, request) in enumerate(requests.items()):
        starts = partition(len(request.prompt_token_ids), num_prefill, r)
        for i, start in enumerate(starts):
            last = i == num_prefill - 1
            end = len(request.prompt_token_ids) if last else starts[i + 1]
            part = request if last else GenerationRequest(request.prompt_token_ids[:end],
                                                          SamplingParams(max_new_tokens=1))
            roles[i].apply(CooperativeSlice(
                rid if last else f"{rid}#{i}", part, decode_rank=d_rank, coop_id=coop_id,
                slice_start=start, prev_rank=i - 1 if i else None,
                next_rank=None if last else i + 1), {})
    try:
        while any(e.has_unfinished() for e in [*engines, d_engine]):
            for engine, role in zip(engines, roles, strict=True):
                outputs = engine.step_outputs()
                for h in role.after_step(outputs):
                    d_role.apply(AddPrefilled(h.request_id, requests[h.request_id], h.token_id,
                                              h.seed, h.num_kv_tokens, h.src), {})
                    d_role.apply(d_role.arrivals.get(timeout=30), {})
                tokens_of(outputs, tokens)
            tokens_of(d_engine.step_outputs(), tokens)
        assert not any(channels.values()) or all(q.empty() for q in channels.values())
        for engine in [*engines, d_engine]:
            engine.scheduler.check_integrity()
            allocator = engine.scheduler.allocator
            assert allocator.num_free_blocks == allocator.num_blocks, "KV leaked"
    finally:
        for role in roles:
            role.close()
        d_role.close()
        for engine in [*engines, d_engine]:
            engine.close()
    return [tokens[rid] for rid in requests]


def tokens_of(outputs, tokens: dict[str, list[int]]) -> None:
    for out in outputs:
        if out.token_id is not None and out.request_id in tokens:
            tokens[out.request_id].append(out.token_id)


@pytest.mark.parametrize(("num_prefill", "budget"), [(2, 8), (3, 8), (2, 512)])
def test_cooperative_prefill_equals_transformers(model, hf, num_prefill, budget) -> None:
    """Uneven splits, a prompt shorter than a slice each; a budget that would admit several
    shared prompts in one step admits one (each step trades through one exchange)."""
    prompts = prompts_for(13, lengths=(41, 23, 57, 3))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    got = serve_cooperative(model, prompts, params, num_prefill, max_num_batched_tokens=budget)
    assert got == [hf_greedy(hf, p, 8) for p in prompts]


def test_a_sliding_window_model_places_only_what_its_window_sees(tmp_path) -> None:
    """Mistral's window (12 tokens, blocks of 4), prefix caching on both sides: the decode
    side takes no blocks for the positions a window has slid past (their exported K/V is
    scratch) and so never caches them; prompts sharing a prefix decode as transformers does."""
    path = build_tiny_model(tmp_path / "mistral", arch="mistral")
    mistral = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    shared = [7 + i for i in range(16)]
    prompts = [shared + [100 + i for i in range(20)], shared + [150 + i for i in range(10)],
               shared + [200 + i for i in range(6)]]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    caching = {"enable_prefix_caching": True, "block_size": 4}
    got = serve_split(path, prompts, params, caching, caching)
    assert got == [hf_greedy(mistral, p, 8) for p in prompts]
    assert serve_split.counts["prefill_hits"] > 0  # type: ignore[attr-defined]


def test_two_prefill_workers_share_long_prompts_over_gloo(model, hf) -> None:
    """Shared and handed-off prompts decode as transformers does; requests aborted before,
    during and after the hand-off all end, and every worker's KV is free afterwards."""
    prompts = prompts_for(17, lengths=(45, 12, 60, 20))  # two above the threshold, two below
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    client = start_client(model, max_model_len=160, num_prefill_workers=2,
                          cooperative_prefill_threshold=30)
    try:
        handles = [client.submit(GenerationRequest(tuple(p), params)) for p in prompts]
        got = [[e.token_id for e in h.events() if e.token_id is not None] for h in handles]
        long = SamplingParams(max_new_tokens=90, ignore_eos=True)
        at_once = [client.submit(GenerationRequest(tuple(p), long)) for p in prompts]
        for handle in at_once:  # shared ones before their first token
            handle.abort()
        later = [client.submit(GenerationRequest(tuple(p), long)) for p in prompts]
        for handle in later:
            next(handle.events())  # the first token: on its way to, or at, the decode worker
            handle.abort()
        endings = [list(h.events())[-1].finish_reason for h in at_once + later]
        deadline = time.monotonic() + 10
        while client.gauges().kv_blocks_used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.gauges().kv_blocks_used == 0 and client.is_alive()
    finally:
        client.shutdown(5)
    assert got == [hf_greedy(hf, p, 8) for p in prompts]
    assert set(endings) <= {"abort", "length"}


def test_a_dead_worker_fails_its_requests_and_ping_turns_503(model) -> None:
    """A decode worker killed mid-request: its request ends with an error, so does one still
    at the prefill worker bound for it, the core says it is not alive (/ping answers 503 from
    that), a new request is refused; nothing hangs."""
    client = start_client(model, max_model_len=256)
    try:
        workers = client._loop._core.workers  # noqa: SLF001 - the processes to kill
        victim = next(w for w in workers if w.role == "decode")
        params = SamplingParams(max_new_tokens=140, ignore_eos=True)
        decoding = client.submit(GenerationRequest((5, 6, 7), params))
        events = decoding.events()
        next(events)  # its first token came from the prefill worker
        prefilling = client.submit(GenerationRequest(tuple(range(5, 105)), params))
        victim.process.kill()
        for handle in (decoding, prefilling):
            ending = list(handle.events())[-1]
            assert ending.finish_reason == "error" and "worker" in (ending.error or "")
        assert not client.is_alive()
        with pytest.raises(EngineDeadError):  # the HTTP edge answers 503
            client.submit(GenerationRequest((5, 6), params))
    finally:
        client.shutdown(5)


def test_the_shipped_properties_file_serves_over_http(model, hf, tmp_path) -> None:
    """serving.properties.d/disaggregated.properties behind the real server: streamed and
    whole answers are transformers' greedy tokens, /ping is 200 once every worker is ready."""
    import json
    from pathlib import Path

    import requests
    from transformers import AutoTokenizer

    from tests.server_harness import running_server

    shipped = Path(__file__).resolve().parent.parent / "serving.properties.d"
    properties = (shipped / "disaggregated.properties").read_text() + (
        "\noption.max_model_len=96\noption.dtype=fp32\noption.device=cpu\n")
    prompt = AutoTokenizer.from_pretrained(model).encode("Once upon a time")
    want = hf_greedy(hf, prompt, 10)
    body = {"inputs": "Once upon a time",
            "parameters": {"max_new_tokens": 10, "min_new_tokens": 10, "details": True}}
    with running_server(tmp_path, model, properties) as srv:
        streamed = requests.post(f"{srv.url}/invocations", json={**body, "stream": True},
                                 timeout=60)
        whole = requests.post(f"{srv.url}/invocations", json=body, timeout=60).json()
        assert requests.get(f"{srv.url}/ping", timeout=5).status_code == 200
        assert "1 prefill and 1 decode workers ready" in srv.log()
    assert [json.loads(line)["token"]["id"] for line in streamed.text.splitlines()] == want
    assert [t["id"] for t in whole["details"]["tokens"]] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_workers_give_transformers_greedy_tokens(model, hf) -> None:
    """On a GPU (one card: workers share it, the KV staged through host memory; two or more:
    NCCL between cards), handed off and shared prompts decode as transformers does."""
    from engine import Disaggregation, EngineClient, EngineConfig

    prompts = prompts_for(23, lengths=(45, 12, 60, 20))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    config = EngineConfig(model=str(model), batching="paged", max_num_seqs=4, dtype="float32",
                          device="cuda", max_model_len=96, disaggregation=Disaggregation(
                              num_prefill_workers=2, cooperative_prefill_threshold=30))
    client = EngineClient.from_config(config, 100)
    client.start()
    try:
        handles = [client.submit(GenerationRequest(tuple(p), params)) for p in prompts]
        got = [[e.token_id for e in h.events() if e.token_id is not None] for h in handles]
    finally:
        client.shutdown(5)
    assert got == [hf_greedy(hf, p, 8) for p in prompts]


def test_grammars_and_penalties_follow_the_first_token_across(model) -> None:
    """The decode side's grammar state and penalties start from the prefill side's token."""
    from engine import GuidedSpec

    prompts = prompts_for(29)[:3]
    params = SamplingParams(max_new_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                            guided=GuidedSpec("regex", "[a-z]+( [a-z]+)*"))
    assert serve_split(model, prompts, params, {}, {}) == serve_whole(model, prompts, params)


def test_a_worker_from_another_host_joins_over_tcp(model, hf, tmp_path) -> None:
    """`batchyard worker --router HOST:PORT` (here on loopback) takes the decode rank the
    router gives it; a wrong key is refused and the router waits for the right one."""
    import os
    import subprocess
    import sys
    import threading
    import time
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from benchmark.servers import free_port
    from engine import Disaggregation, EngineClient, EngineConfig

    port = free_port()
    config = EngineConfig(model=str(model), batching="paged", max_num_seqs=4, dtype="float32",
                          device="cpu", max_model_len=96, disaggregation=Disaggregation(
                              remote_decode_workers=1, worker_port=port, worker_key=b"s3cret"))
    env = {**os.environ, "BATCHYARD_WORKER_KEY": "s3cret"}

    def intruder_then_worker() -> subprocess.Popen:
        while True:  # until the router listens
            try:
                Client(("127.0.0.1", port), authkey=b"wrong")
            except AuthenticationError:
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        worker[0] = subprocess.Popen(
            [sys.executable, "-m", "handler.cli", "worker", "--router", f"127.0.0.1:{port}",
             "--model-dir", str(model)], env=env, stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "worker.log", "w"))

    worker: list = [None]
    joiner = threading.Thread(target=intruder_then_worker, daemon=True)
    joiner.start()
    client = EngineClient.from_config(config, 100)
    client.start()
    try:
        prompts = prompts_for(31)[:3]
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        handles = [client.submit(GenerationRequest(tuple(p), params)) for p in prompts]
        got = [[e.token_id for e in h.events() if e.token_id is not None] for h in handles]
    finally:
        client.shutdown(5)
        joiner.join(5)
        if worker[0] is not None:
            worker[0].wait(10)
    assert got == [hf_greedy(hf, p, 8) for p in prompts]
    assert worker[0].returncode == 0, (tmp_path / "worker.log").read_text()[-2000:]


def test_bench_runahead_reports_ttft_and_the_slices(model, tmp_path) -> None:
    import json

    from benchmark.cli import main

    out = tmp_path / "runahead"
    assert main(["runahead", "--model-dir", str(model), "--prompt-tokens", "60", "--repeats",
                 "1", "--workers", "2", "--no-colocated", "--no-even-split", "--out",
                 str(out)]) == 0
    (row,) = json.loads((out / "runahead.json").read_text())["rows"].values()
    assert row["prefill_workers"] == 2 and sum(row["slices"]) == 60 and row["ttft_s"][0] > 0
    assert "2 prefill workers + 1 decode" in (out / "runahead.md").read_text()


def test_a_worker_that_cannot_load_stops_the_start_with_its_reason(model) -> None:
    """The first worker to fail ends the start (its one-line configuration error), whatever
    the others are waiting for."""
    with pytest.raises(ValueError, match="invalid max_model_len"):
        start_client(model, max_model_len=100_000)


def test_the_router_leaves_torch_to_the_workers() -> None:
    """The serving process imports no torch for disaggregated serving (only its workers do):
    it stays light, and no torch threads meet its interpreter's exit."""
    import subprocess
    import sys

    code = "import sys, engine.disagg.router; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


TRANSFER = 'option.kv_transfer_config={"kv_connector": "TorchDistributedConnector"'
KEY_REFUSALS = {
    "unknown connector": ('option.kv_transfer_config={"kv_connector": "NixlConnector"}',
                          "option.kv_transfer_config", "TorchDistributedConnector"),
    "producer role": (TRANSFER + ', "kv_role": "kv_producer"}', "option.kv_transfer_config",
                      "kv_both"),
    "workers without transfer": ("option.num_decode_workers=2", "option.num_decode_workers",
                                 "kv_transfer_config"),
    "threshold 1": (TRANSFER + "}\noption.cooperative_prefill_threshold=1",
                    "option.cooperative_prefill_threshold", "0 (never)"),
    "too many workers": (TRANSFER + "}\noption.num_prefill_workers=65",
                         "option.num_prefill_workers", "1..64"),
    "tensor parallel": (TRANSFER + "}\noption.tensor_parallel_degree=2",
                        "option.kv_transfer_config", "tensor parallelism"),
    "remote rank 0": (TRANSFER + ', "kv_ip": "10.0.0.1", "kv_connector_extra_config": '
                      '{"remote_prefill_workers": 1, "worker_port": 14580}}',
                      "option.kv_transfer_config", "the first prefill worker runs here"),
    "remote on loopback": (TRANSFER + ', "kv_connector_extra_config": '
                           '{"remote_decode_workers": 1, "worker_port": 14580}}',
                           "option.kv_transfer_config", "kv_ip"),
    "remote without a port": (TRANSFER + ', "kv_ip": "10.0.0.1", "kv_connector_extra_config": '
                              '{"remote_decode_workers": 1}}', "option.kv_transfer_config",
                              "worker_port"),
}


@pytest.mark.parametrize("case", KEY_REFUSALS)
def test_disaggregation_keys_refuse_what_cannot_run_by_name(case, monkeypatch) -> None:
    from handler.config.setting import ConfigError
    from tests.test_properties import resolve

    monkeypatch.setenv("BATCHYARD_WORKER_KEY", "s3cret")
    text, key, why = KEY_REFUSALS[case]
    with pytest.raises(ConfigError) as err:
        resolve(f"option.rolling_batch=paged\n{text}")
    assert f"invalid {key}=" in str(err.value) and why in str(err.value)


def test_disaggregation_keys_reach_the_engine_config(monkeypatch) -> None:
    from tests.test_properties import resolve

    monkeypatch.setenv("BATCHYARD_WORKER_KEY", "s3cret")
    config = resolve("option.rolling_batch=paged\n" + TRANSFER + ', "kv_ip": "10.0.0.1", '
                     '"kv_port": 14579, "kv_connector_extra_config": {"remote_decode_workers": '
                     '1, "worker_port": 14580}}\noption.num_prefill_workers=2\n'
                     "option.num_decode_workers=2\noption.cooperative_prefill_threshold=0")
    plan = config.engine.disaggregation
    assert (plan.num_prefill_workers, plan.num_decode_workers, plan.remote_decode_workers,
            plan.worker_port, plan.worker_key, plan.kv_ip, plan.kv_port,
            plan.cooperative_prefill_threshold) == (2, 2, 1, 14580, b"s3cret", "10.0.0.1",
                                                    14579, None)
    assert "s3cret" not in repr(config.engine)
