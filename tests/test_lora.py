"""LoRA adapters in the engine (engine/lora/): greedy float32 output equals transformers + PEFT
(the adapter applied unmerged) token for token, for each adapter in mixed batches, in every
strategy, with chunked prefill, preemption, prefix caching, the padded (graph) path and tensor
parallelism 2; rsLoRA and per-module ranks; slots shared by more adapters than they hold; run-time
registration and retirement; adapters refused with their reason."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import engine.kernels as kernels
from engine import SamplingParams
from engine.inputs import GenerationRequest
from engine.lora.errors import AdapterError, AdapterNotFound, UnknownAdapter
from engine.sequence import FinishReason
from tests.engine_harness import Req, drive, greedy, hf_greedy, make_engine
from tests.models_fixtures import build_tiny_model

NEW_TOKENS = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, folder, seed: int, **options):
    """A PEFT adapter with random A and B (PEFT starts B at zero: no update to test) saved to
    `folder`; returns the PEFT model (the reference)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(init_lora_weights=False, **{"r": 4, "lora_alpha": 8,
                                                    "target_modules": ALL, **options})
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(folder)
    return peft_model.eval()


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A tiny Llama, three adapters (plain; rsLoRA on some modules; per-module ranks and
    alphas), prompts and each adapter's (and the base model's) greedy tokens."""
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(root / "base", arch="llama")
    peft_models = {
        "plain": make_adapter(base, root / "plain", 1),
        "rs": make_adapter(base, root / "rs", 2, r=8, lora_alpha=4, use_rslora=True,
                           target_modules=["q_proj", "v_proj", "down_proj"]),
        "patterned": make_adapter(base, root / "patterned", 3, r=4,
                                  rank_pattern={"v_proj": 2, "layers.1.mlp.up_proj": 8},
                                  alpha_pattern={"o_proj": 3}),
    }
    rng = random.Random(4)
    shared = [rng.randrange(3, 200) for _ in range(9)]
    prompts = [shared + [rng.randrange(3, 200) for _ in range(n)] for n in (3, 11)]
    prompts += [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17)]
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    refs = {None: [hf_greedy(base_model, p, NEW_TOKENS) for p in prompts]}
    for name, model in peft_models.items():
        refs[name] = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert all(refs[name] != refs[None] for name in peft_models), "an adapter changes nothing"
    modules = tuple((name, str(root / name)) for name in peft_models)
    return base, root, modules, prompts, refs


def mixed_requests(prompts, adapters=(None, "plain", "rs", "patterned")) -> list[Req]:
    """Every prompt under every adapter, arriving over a few steps."""
    return [Req(f"{i}:{name}", prompt, replace(greedy(NEW_TOKENS), adapter=name), (i + j) % 3)
            for i, prompt in enumerate(prompts) for j, name in enumerate(adapters)]


def check(reqs: list[Req], refs) -> None:
    for req in reqs:
        index, name = req.request_id.split(":")
        want = refs[None if name == "None" else name][int(index)]
        assert req.tokens == want, req.request_id


def lora_engine(lora, batching: str, **overrides):
    base, _, modules, _, _ = lora
    return make_engine(base, batching, enable_lora=True, lora_modules=modules,
                       **{"max_num_seqs": 8 if batching != "none" else 1, **overrides})


STRATEGY_CASES = {
    "none": ("none", {}),
    "dynamic": ("dynamic", {}),
    "continuous": ("continuous", {}),
    "paged": ("paged", {}),
    "paged-chunks-prefix": ("paged", {"max_num_batched_tokens": 6, "block_size": 4,
                                      "enable_prefix_caching": True}),
    "paged-preemption": ("paged", {"block_size": 4, "num_kv_blocks": 22,
                                   "max_num_batched_tokens": 16}),
    "paged-padded": ("paged", {"padded_decode_on_cpu": True}),
    "continuous-two-slots": ("continuous", {"max_loras": 2}),
}


@pytest.mark.parametrize("case", list(STRATEGY_CASES))
def test_mixed_adapters_give_peft_tokens(lora, case) -> None:
    batching, options = STRATEGY_CASES[case]
    engine = lora_engine(lora, batching, **options)
    max_loras = engine.config.max_loras
    seen = []

    def distinct_running(engine) -> None:  # the device has max_loras slots
        keys = {s.lora_key for s in engine.scheduler.running if s.lora_key is not None}
        seen.append(len(keys))
        assert len(keys) <= max_loras

    reqs = mixed_requests(lora[3])
    drive(engine, reqs, after_step=distinct_running)
    check(reqs, lora[4])
    if case == "paged-preemption":
        assert engine.scheduler.num_preemptions > 0
    if case == "paged-padded":
        assert engine.runner.padded_decode.steps > 0
    if case == "paged" and kernels.compiler():  # few rows per adapter: the C kernel ran
        assert engine.runner.lora.context.kernel is not None
    if case == "continuous-two-slots":  # three adapters through two slots: some waited
        assert max(seen) == 2 and engine.runner.lora.slots.clock > 0


def test_prefix_cache_never_shares_kv_between_adapters(lora) -> None:
    """The same prompt under the base model, then two adapters, then the first again: only
    the repeat finds cached blocks, and every answer is its own adapter's."""
    engine = lora_engine(lora, "paged", block_size=4, enable_prefix_caching=True)
    prompt = lora[3][1]
    allocator = engine.scheduler.allocator
    for turn, name in enumerate((None, "plain", "rs", "plain")):
        hits = allocator.prefix_hits
        req = Req(f"1:{name}", prompt, replace(greedy(NEW_TOKENS), adapter=name))
        drive(engine, [req])
        check([req], lora[4])
        assert (allocator.prefix_hits > hits) == (turn == 3), name


def test_two_tensor_parallel_ranks(lora) -> None:
    """Each rank keeps its shard of every A or B (q/k/v/gate/up by output rows, o/down by
    input columns) and the ranks' partial updates sum to PEFT's."""
    engine = lora_engine(lora, "paged", tensor_parallel_size=2)
    try:
        reqs = mixed_requests(lora[3])
        drive(engine, reqs)
    finally:
        engine.close()
    check(reqs, lora[4])


def test_register_serve_retire_and_register_again(lora, tmp_path) -> None:
    base, root, _, prompts, refs = lora
    engine = make_engine(base, "continuous", enable_lora=True, max_loras=1)
    with pytest.raises(UnknownAdapter, match="'plain' is not registered"):
        engine.validate(prompts[0], replace(greedy(4), adapter="plain"))
    engine.add_adapter("plain", str(root / "plain"))
    assert engine.adapter_names() == ["plain"]
    with pytest.raises(AdapterError, match="already registered"):
        engine.add_adapter("plain", str(root / "rs"))
    tokens: dict[str, list[int]] = {"0:plain": [], "0:rs": []}

    def step() -> None:
        for event in engine.step():
            if event.token_id is not None:
                tokens[event.request_id].append(event.token_id)

    engine.add_request("0:plain", prompts[0], replace(greedy(NEW_TOKENS), adapter="plain"))
    step()  # it runs; now it retires under it
    engine.remove_adapter("plain")
    with pytest.raises(UnknownAdapter):
        engine.validate(prompts[0], replace(greedy(4), adapter="plain"))
    # the same name, other weights: a new registration, beside the retiring one (which holds
    # the one slot: the new one waits for it)
    shutil.copytree(root / "rs", tmp_path / "other")
    engine.add_adapter("plain", str(tmp_path / "other"))
    engine.add_request("0:rs", prompts[0], replace(greedy(NEW_TOKENS), adapter="plain"))
    while engine.has_unfinished():
        step()
    # the first kept its weights, the second got the new ones
    assert tokens == {"0:plain": refs["plain"][0], "0:rs": refs["rs"][0]}
    assert list(engine.runner.adapters.paths) == ["plain@2"]  # the retired one forgotten
    with pytest.raises(AdapterNotFound):
        engine.remove_adapter("nope")


def test_an_unknown_adapter_past_the_boundary_ends_its_request(lora) -> None:
    engine = lora_engine(lora, "paged")
    # (the boundary, LLMEngine.validate, refuses it: a core in another process may be asked
    # before a front learns the adapter is gone)
    engine.add_validated("x", GenerationRequest(tuple(lora[3][0]),
                                                replace(greedy(4), adapter="missing")))
    [output] = engine.step_outputs()
    assert output.finish_reason == FinishReason.UNKNOWN_ADAPTER
    assert "'missing' is not registered (registered: patterned, plain, rs)" in output.error
    assert not engine.has_unfinished()


def test_a_request_naming_an_adapter_without_lora_is_refused(lora) -> None:
    engine = make_engine(lora[0], "paged")
    with pytest.raises(UnknownAdapter, match="registered: none"):
        engine.validate([5, 6], SamplingParams(adapter="plain"))
    with pytest.raises(RuntimeError, match="enable_lora"):
        engine.add_adapter("plain", str(lora[1] / "plain"))


def rewrite(folder, config: dict | None = None, tensors=None) -> None:
    """Change an adapter folder's config fields and/or tensors."""
    if config is not None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        weights = load_file(str(folder / "adapter_model.safetensors"))
        save_file(tensors(weights), str(folder / "adapter_model.safetensors"))


def first_a(weights: dict) -> str:
    return next(k for k in weights if k.endswith("lora_A.weight"))


BAD = {
    "dora": ({"use_dora": True}, None, "DoRA"),
    "bias": ({"bias": "all"}, None, "bias='all'"),
    "saved-modules": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "pissa": ({"init_lora_weights": "pissa"}, None, "rewrites the base weights"),
    "alpha-text": ({"lora_alpha": "16"}, None, "lora_alpha '16'"),
    "pattern-regex": ({"rank_pattern": {"q_proj(": 8}}, None, "not a map of module patterns"),
    "rank": ({"r": 32, "rank_pattern": {}}, None, "not \\[r, in\\]"),
    "embedding": (None, lambda w: {**w, "base_model.model.model.embed_tokens.lora_embedding_A":
                                   torch.zeros(4, 10)}, "embedding LoRA"),
    "lm-head": (None, lambda w: {**w, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 8),
                                 "base_model.model.lm_head.lora_B.weight": torch.zeros(8, 4)},
                "unknown target module lm_head"),
    "shape": (None, lambda w: {**w, first_a(w): torch.zeros(4, 7)}, "this model needs"),
    "missing-b": (None, lambda w: {k: v for k, v in w.items() if "lora_B" not in k},
                  "lora_B.weight is missing"),
    "layer": (None, lambda w: {**w, first_a(w).replace("layers.0", "layers.9"):
                               w[first_a(w)].clone(),
                               first_a(w).replace("layers.0", "layers.9").replace("lora_A",
                                                                                 "lora_B"):
                               torch.zeros(64, 4)}, "not a layer of this model"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapters_are_refused_with_their_reason(lora, tmp_path, case) -> None:
    base, root, _, prompts, refs = lora
    config, tensors, reason = BAD[case]
    folder = tmp_path / case
    shutil.copytree(root / "plain", folder)
    rewrite(folder, config, tensors)
    engine = lora_engine(lora, "paged")
    with pytest.raises(AdapterError, match=reason):
        engine.add_adapter(case, str(folder))
    assert case not in engine.adapter_names()
    req = Req("0:plain", prompts[0], replace(greedy(NEW_TOKENS), adapter="plain"))
    drive(engine, [req])  # the others unharmed
    check([req], refs)


def test_folders_without_safetensors_or_config_are_refused(lora, tmp_path) -> None:
    engine = lora_engine(lora, "paged", max_lora_rank=8)
    folder = tmp_path / "bin-only"
    shutil.copytree(lora[1] / "plain", folder)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="safetensors only"):
        engine.add_adapter("bin", str(folder))
    (folder / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        engine.add_adapter("bin", str(folder))
    with pytest.raises(AdapterError, match="not a folder"):
        engine.add_adapter("nowhere", str(tmp_path / "nowhere"))


def test_a_start_up_adapter_above_the_rank_limit_stops_the_start(lora) -> None:
    with pytest.raises(ValueError, match="invalid lora_modules: adapter 'plain': rank 4 .* "
                                         "above max_lora_rank=1"):
        lora_engine(lora, "paged", max_lora_rank=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_on_cuda_with_graphs_gives_peft_tokens(lora) -> None:
    """float32 on the GPU: masked updates in every step, captured in the decode graphs."""
    engine = lora_engine(lora, "paged", device="cuda")
    assert engine.runner.padded_decode is not None and engine.runner.padded_decode.graphs
    reqs = mixed_requests(lora[3])
    drive(engine, reqs)
    check(reqs, lora[4])


def test_a_failed_slot_load_leaves_the_slot_empty(lora) -> None:
    """A load that raises (a folder gone, memory) must not leave the slot table saying the slot
    holds the adapter: the next step naming it loads it again, not another's weights."""
    engine = lora_engine(lora, "paged")
    runtime, registry = engine.runner.lora, engine.runner.adapters
    rows, loads = runtime.plan_rows(["plain@1"], [3], registry.path_of)

    def broken(key: str):
        raise OSError("the folder is gone")

    with pytest.raises(OSError):
        runtime.stage(rows, loads, broken, padded=False)
    assert "plain@1" not in runtime.slots.held
    req = Req("0:plain", lora[3][0], replace(greedy(NEW_TOKENS), adapter="plain"))
    drive(engine, [req])
    check([req], lora[4])


def test_a_retiring_adapter_stays_read_when_its_folder_goes(lora, tmp_path) -> None:
    base, root, _, prompts, refs = lora
    shutil.copytree(root / "plain", tmp_path / "plain")
    engine = make_engine(base, "paged", enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine.add_adapter("plain", str(tmp_path / "plain"))
    engine.add_adapter("rs", str(root / "rs"))  # pushes plain out of the host cache
    engine.add_request("0:plain", prompts[0], replace(greedy(NEW_TOKENS), adapter="plain"))
    engine.remove_adapter("plain")  # in use: it retires, read again now
    shutil.rmtree(tmp_path / "plain")
    tokens = []
    while engine.has_unfinished():
        tokens += [e.token_id for e in engine.step() if e.token_id is not None]
    assert tokens == refs["plain"][0]
