"""The transformers fallback: architectures batchyard has no native modules for run as
transformers builds them, on batchyard's KV pool. Greedy output equals transformers `generate`
token for token in every strategy (preemption and prefix caching forced in paged), streamed
through a real server too, Gemma 2's soft-capping and per-layer windows included; what cannot be
served is refused at load, naming the architecture."""

from __future__ import annotations

import json
import random

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import SamplingParams
from tests.engine_harness import Req, drive, greedy, hf_greedy, make_engine
from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

STRATEGIES = [("none", {}), ("dynamic", {}), ("continuous", {}),
              ("continuous", {"max_num_batched_tokens": 20}), ("paged", {}),
              ("paged", {"max_num_seqs": 8, "block_size": 4, "num_kv_blocks": 12,
                         "enable_prefix_caching": True, "max_num_batched_tokens": 16})]


def fixture_for(arch: str):
    @pytest.fixture(scope="module")
    def tiny(tmp_path_factory):
        path = build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rng = random.Random(3)
        shared = [rng.randrange(3, 300) for _ in range(9)]  # a prefix the cache can share
        prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 17, 9)]
        prompts += [shared + [7, 8], shared + [9]]
        new = [12, 3, 16, 7, 10, 10]
        refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new, strict=True)]
        return path, prompts, new, refs
    return tiny


neox = fixture_for("gpt_neox")
opt = fixture_for("opt")
gemma2 = fixture_for("gemma2")  # soft-capping, and a sliding window on every other layer


@pytest.mark.parametrize("family", ["neox", "opt", "gemma2"])
@pytest.mark.parametrize(("batching", "overrides"), STRATEGIES,
                         ids=[f"{b}-{i}" for i, (b, _) in enumerate(STRATEGIES)])
def test_fallback_greedy_equals_generate(request, family, batching, overrides) -> None:
    path, prompts, new, refs = request.getfixturevalue(family)
    if family == "gemma2" and overrides.get("num_kv_blocks"):  # two block tables (KV groups),
        overrides = {**overrides, "num_kv_blocks": 2 * overrides["num_kv_blocks"]}  # one layer each
    reqs = [Req(f"r{i}", p, greedy(n), arrive_at_step=i)
            for i, (p, n) in enumerate(zip(prompts, new, strict=True))]
    engine = make_engine(path, batching, model_impl="transformers", **overrides)  # Gemma 2:
    assert type(engine.runner.model).__name__ == "TransformersModel"  # native under auto
    drive(engine, reqs)
    if overrides.get("num_kv_blocks"):
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.allocator.prefix_hits > 0
    assert [r.tokens for r in reqs] == refs


@pytest.mark.parametrize("arch", ["phi3", "gemma", "gemma3", "gpt2", "llama"])
def test_more_families_and_a_forced_llama(tmp_path, arch) -> None:
    """Phi-3, Gemma, Gemma 3 (a sliding and a full layer) and GPT-2 through the fallback; a
    Llama too with model_impl=transformers."""
    path = build_tiny_model(tmp_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 9, 40, 7], list(range(20, 45))]  # longer than the Gemma windows (6)
    refs = [hf_greedy(model, p, 9) for p in prompts]
    reqs = [Req(f"r{i}", p, greedy(9)) for i, p in enumerate(prompts)]
    drive(make_engine(path, "paged", model_impl="transformers"), reqs)
    assert [r.tokens for r in reqs] == refs


def test_streamed_through_a_server_equals_generate(tmp_path) -> None:
    path = build_tiny_model(tmp_path / "model", arch="gpt_neox")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    properties = "option.rolling_batch=paged\noption.max_model_len=96\n"
    with running_server(tmp_path, path, properties) as srv:
        r = requests.post(f"{srv.url}/invocations", timeout=60, json={
            "inputs": "Once upon a time", "stream": True,
            "parameters": {"max_new_tokens": 10, "min_new_tokens": 10, "details": True}})
        lines = [json.loads(line) for line in r.text.splitlines()]
        assert "transformers fallback" in srv.log()
    ids = [line["token"]["id"] for line in lines]
    prompt = AutoTokenizer.from_pretrained(path).encode("Once upon a time")
    assert ids == hf_greedy(model, prompt, 10)


def write_config(path, **config) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")


@pytest.mark.parametrize(("config", "message"), [
    ({"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True},
     "T5ForConditionalGeneration is an encoder-decoder model"),
    ({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {}},
     "LlavaForConditionalGeneration takes images or audio"),
    ({"architectures": ["MyForCausalLM"], "auto_map": {"AutoModelForCausalLM": "m.My"}},
     "MyForCausalLM needs the model folder's own code"),
])
def test_what_cannot_be_served_is_refused_naming_the_architecture(tmp_path, config,
                                                                  message) -> None:
    write_config(tmp_path, **config)
    with pytest.raises(ValueError, match=message):
        make_engine(tmp_path, "paged")


@pytest.mark.parametrize(("arch", "overrides", "message"), [
    ("gpt_neox", {"tensor_parallel_size": 2}, "no tensor parallelism"),
    ("gpt_neox", {"model_impl": "native"}, "not supported natively"),
    ("gpt_neox", {"quantize": "int8"}, "needs a native model"),
])
def test_native_only_features_are_refused_for_the_fallback(tmp_path, arch, overrides,
                                                           message) -> None:
    path = build_tiny_model(tmp_path, arch=arch)
    with pytest.raises(ValueError, match=message):
        make_engine(path, "paged", **overrides)


def test_sampled_and_guided_requests_work_on_the_fallback(neox) -> None:
    from engine.guided import GuidedSpec

    engine = make_engine(neox[0], "paged")
    reqs = [Req("s", [5, 6, 7], SamplingParams(max_new_tokens=8, do_sample=True, seed=4,
                                               top_p=0.9)),
            Req("g", [5, 6, 7], SamplingParams(max_new_tokens=20,
                                               guided=GuidedSpec("regex", "[0-9]{3}")))]
    drive(engine, reqs)
    assert len(reqs[0].tokens) == 8 and engine.tokenizer.decode(reqs[1].tokens).isdigit()


def gpt_oss():
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=256)


def jamba():
    from transformers import JambaConfig

    return JambaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                       attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                       num_experts=2, mamba_d_state=8, mamba_expand=2)


@pytest.mark.parametrize(("make_config", "message"), [
    (gpt_oss, "GptOssForCausalLM passes its attention s_aux"),  # attention sinks
    (jamba, "JambaForCausalLM keeps a recurrent state"),  # Mamba layers
])
def test_what_the_paged_attention_would_get_wrong_is_refused(tmp_path, make_config,
                                                              message) -> None:
    build_tiny_model(tmp_path)  # the tokenizer; the weights are replaced below
    AutoModelForCausalLM.from_config(make_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        make_engine(tmp_path, "paged")
