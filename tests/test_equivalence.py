"""The key correctness test: greedy float32 output equals transformers `generate`, token for
token, in every strategy, with requests joining and leaving mid-flight and mixed parameters."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from tests.engine_harness import Req, drive, greedy, hf_greedy, make_engine, staggered_requests
from tests.models_fixtures import build_tiny_model

ARCHS = ["llama", "llama_tied_llama3", "mistral", "qwen2", "qwen3", "phi3", "phi3_longrope",
         "mixtral", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "gemma3"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    """(model dir, prompts, reference greedy continuations) for one architecture."""
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    rng = random.Random(7)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 33, 9, 24)]
    new_tokens = [12, 3, 16, 7, 20, 1]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    return path, prompts, new_tokens, refs, model


def staggered(prompts, new_tokens) -> list[Req]:
    """Requests arriving at different steps with different lengths: they join and leave."""
    return staggered_requests(prompts, new_tokens, [0, 0, 2, 5, 6, 11])


STRATEGIES = [
    ("none", {}),
    ("dynamic", {}),
    ("dynamic", {"max_num_seqs": 2, "max_batch_delay_ms": 5.0}),
    ("continuous", {}),
    ("continuous", {"max_num_batched_tokens": 20}),
    ("paged", {}),
]


@pytest.mark.parametrize("backend", ["reference", "cpu_paged"])
@pytest.mark.parametrize(("batching", "overrides"), STRATEGIES,
                         ids=[f"{b}-{i}" for i, (b, _) in enumerate(STRATEGIES)])
def test_greedy_matches_transformers_generate(tiny, batching, overrides, backend) -> None:
    """Every strategy reproduces transformers' greedy tokens for staggered requests, with the
    pure-PyTorch reference attention and with the CPU decode kernel."""
    path, prompts, new_tokens, refs, _ = tiny
    reqs = staggered(prompts, new_tokens)
    engine = make_engine(path, batching, attention_backend=backend, **overrides)
    assert engine.runner.attention.name == backend
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs


def test_mixed_sampling_parameters_in_one_batch(tiny) -> None:
    """Sampled neighbours neither change greedy rows nor depend on the batch around them."""
    path, prompts, new_tokens, refs, model = tiny
    sampled = [SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20,
                              top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    penalised = SamplingParams(max_new_tokens=8, repetition_penalty=1.3, ignore_eos=True)
    reqs = [Req("g0", prompts[2], greedy(new_tokens[2])), Req("s1", prompts[1], sampled[0]),
            Req("p2", prompts[3], penalised), Req("s2", prompts[1], sampled[1]),
            Req("g1", prompts[4], greedy(new_tokens[4]), 3)]
    drive(make_engine(path, "continuous", max_num_seqs=5), reqs)
    assert reqs[0].tokens == refs[2] and reqs[4].tokens == refs[4]
    assert reqs[2].tokens == hf_greedy(model, prompts[3], 8, repetition_penalty=1.3)
    alone = Req("s1", prompts[1], sampled[0])
    drive(make_engine(path, "none"), [alone])
    assert alone.tokens == reqs[1].tokens, "a seeded request depends on its batch"
    assert reqs[1].tokens != reqs[3].tokens, "different seeds gave the same sample"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["reference", "flex"])
@pytest.mark.parametrize("batching", ["none", "dynamic", "continuous", "paged"])
def test_greedy_matches_transformers_generate_on_gpu(tiny, batching, backend) -> None:
    """On CUDA in float32, each strategy and attention backend gives generate's greedy tokens
    (generate also on CUDA: the GPU's own rounding on both sides)."""
    path, prompts, new_tokens, _, _ = tiny
    cuda = torch.device("cuda")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(cuda).eval()
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    reqs = staggered(prompts, new_tokens)
    drive(make_engine(path, batching, device="cuda", attention_backend=backend), reqs)
    assert [r.tokens for r in reqs] == refs


@pytest.mark.parametrize("batching", ["continuous", "paged"])
def test_layers_mixing_full_and_sliding_window_attention_run_natively(tmp_path,
                                                                     batching) -> None:
    """Qwen3 with use_sliding_window and max_window_layers: a full layer and a windowed one,
    each reading its own window's metadata (eagerly and through the padded decode path)."""
    path = build_tiny_model(tmp_path, arch="qwen3", use_sliding_window=True, sliding_window=8,
                            max_window_layers=1)
    engine = make_engine(path, batching, padded_decode_on_cpu=True)
    assert type(engine.runner.model).__name__ == "LlamaForCausalLM"
    assert engine.runner.spec.layer_windows == (None, 8)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(range(5, 25)), list(range(40, 43))]
    reqs = [Req(f"r{i}", p, greedy(14), i) for i, p in enumerate(prompts)]
    drive(engine, reqs)
    assert engine.runner.padded_decode.steps > 0
    assert [r.tokens for r in reqs] == [hf_greedy(model, p, 14) for p in prompts]


def test_preemption_keeps_every_native_family_equal_to_generate(tiny) -> None:
    """Paged with a pool too small for the batch: sequences are preempted and recomputed, and
    the tokens still equal transformers'. (A model mixing full and windowed layers keeps its KV
    in two block tables of one layer each: the same memory is twice the blocks.)"""
    path, prompts, new_tokens, refs, model = tiny
    reqs = staggered(prompts, new_tokens)
    hybrid = len(set(getattr(model.config, "layer_types", None) or ())) > 1
    engine = make_engine(path, "paged", block_size=4, num_kv_blocks=22 if hybrid else 11)
    assert engine.runner.layout.num_tables == (2 if hybrid else 1)
    drive(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    assert [r.tokens for r in reqs] == refs
