"""Disaggregated prefill and decode (engine/disagg/): a prompt's KV moves from a prefill
engine's pool to a decode engine's, and greedy output stays transformers' token for token."""

from __future__ import annotations

import queue
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from engine.disagg.roles import Arrived, DecodeRole, PrefillRole
from engine.inputs import AddPrefilled, GenerationRequest, PrefillRequest
from tests.engine_harness import hf_greedy, make_engine
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

    def recv(self, shape, dtype, src: int, tag: int) -> torch.Tensor:
        tensor = self._channel(src, self.rank, tag).get(timeout=30)
        assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype
        return tensor


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("disagg"))


@pytest.fixture(scope="module")
def hf(model):
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def prompts_for(seed: int, lengths=(9, 37, 4, 21, 30)) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(16)]  # a prefix two prompts share
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
    prompts[1] = shared + prompts[1]
    prompts[3] = shared + prompts[3]
    return prompts


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
    for rid, request in requests.items():
        p_role.apply(PrefillRequest(rid, request, decode_rank=1), {})
    try:
        for _ in range(2000):
            if not (p_engine.has_unfinished() or d_engine.has_unfinished()
                    or len(d_role.take_arrivals()) > 0) and all(
                    len(t) == params.max_new_tokens for t in tokens.values()):
                break
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


def test_sampled_output_follows_the_seed_across_the_hand_off(model) -> None:
    prompts = prompts_for(5)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, seed=7,
                            do_sample=True, ignore_eos=True)
    split = serve_split(model, prompts, params, {}, {})
    whole = serve_whole(model, prompts, params)
    assert split == whole


def serve_whole(model, prompts, params) -> list[list[int]]:
    engine = make_engine(model, "paged")
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step_outputs():
                if out.token_id is not None:
                    tokens[out.request_id].append(out.token_id)
    finally:
        engine.close()
    return [tokens[f"r{i}"] for i in range(len(prompts))]


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
            for out in d_engine.step_outputs():
                if out.token_id is not None:
                    tokens[out.request_id].append(out.token_id)
    finally:
        p_engine.close()
        d_engine.close()
    assert [tokens[f"r{i}"] for i in range(2)] == [hf_greedy(hf, p, 8) for p in prompts]


# --- worker processes behind the router, the KV over gloo ---

def serve_client(model, prompts, params, **disagg):
    from engine import EngineClient, EngineConfig
    from engine.config import Disaggregation

    config = EngineConfig(model=str(model), batching="paged", max_num_seqs=4, dtype="float32",
                          device="cpu", max_model_len=96,
                          disaggregation=Disaggregation(**disagg))
    client = EngineClient.from_config(config, 100)
    client.start()
    try:
        handles = [client.submit(GenerationRequest(tuple(p), params)) for p in prompts]
        return [[e.token_id for e in h.events() if e.token_id is not None] for h in handles]
    finally:
        client.shutdown(5)


def test_workers_over_gloo_serve_transformers_greedy_tokens(model, hf) -> None:
    prompts = prompts_for(11)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    got = serve_client(model, prompts, params)
    assert got == [hf_greedy(hf, p, 10) for p in prompts]
