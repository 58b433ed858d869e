"""Drive an LLMEngine directly in tests, and compute transformers' greedy reference."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from transformers import GenerationConfig

from engine import EngineConfig, LLMEngine, SamplingParams

MAX_MODEL_LEN = 96


@dataclass
class Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrive_at_step: int = 0
    tokens: list[int] = field(default_factory=list)


def hf_greedy(model, prompt: list[int], max_new: int, **extra) -> list[int]:
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                              eos_token_id=None, pad_token_id=0, **extra)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                       device=model.device),
                             generation_config=config)
    return out[0, len(prompt):].tolist()


def make_engine(path, batching: str, **overrides) -> LLMEngine:
    defaults = {"max_num_seqs": 1 if batching == "none" else 4, "max_batch_delay_ms": 0.0,
                "dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN}
    config = EngineConfig(model=str(path), batching=batching, **{**defaults, **overrides})
    return LLMEngine.from_config(config)


def drive(engine: LLMEngine, reqs: list[Req], max_steps: int = 5000,
          after_step: Callable[[LLMEngine], None] | None = None) -> None:
    """Feed requests at their arrival step, step until all finish, check integrity throughout;
    `after_step` looks at the engine after each step."""
    by_id = {r.request_id: r for r in reqs}
    pending = sorted(reqs, key=lambda r: r.arrive_at_step)
    for step in range(max_steps):
        while pending and pending[0].arrive_at_step <= step:
            r = pending.pop(0)
            engine.add_request(r.request_id, r.prompt, r.params)
        if not pending and not engine.has_unfinished():
            break
        for event in engine.step():
            if event.token_id is not None:
                by_id[event.request_id].tokens.append(event.token_id)
        engine.scheduler.check_integrity()
        if after_step is not None:
            after_step(engine)
    else:
        pytest.fail("engine did not drain")
    allocator = engine.scheduler.allocator
    assert allocator.num_free_blocks == allocator.num_blocks, "KV leaked after drain"


def staggered_requests(prompts: Sequence[list[int]], new_tokens: Sequence[int],
                       arrivals: Sequence[int]) -> list[Req]:
    """Greedy requests r0, r1, ... arriving at the given steps: they join and leave."""
    return [Req(f"r{i}", p, greedy(n), a)
            for i, (p, n, a) in enumerate(zip(prompts, new_tokens, arrivals, strict=True))]


def prompts_sharing_a_prefix(seed: int, lengths: Sequence[int], shared: int) -> list[list[int]]:
    """Random prompts of the given lengths (ids 3..299), the second and fourth behind one
    `shared`-token prefix (prefix caching finds it)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(shared)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
    for i in (1, 3):
        if i < len(prompts):
            prompts[i] = prefix + prompts[i]
    return prompts


def prompts_with_references(path, seed: int, shared: int, tails: Sequence[int],
                            lone: Sequence[int], new_tokens: Sequence[int]):
    """(prompts, transformers' greedy continuations): prompts of one `shared`-token prefix plus
    tails of the given lengths (prefix caching finds them), then unrelated ones."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in tails]
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in lone]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    return prompts, refs


def greedy(n: int) -> SamplingParams:
    """Exactly n greedy tokens, EOS suppressed until then, as hf_greedy's min_new_tokens does
    (transformers takes the model's EOS when the generation config leaves it unset). With
    ignore_eos instead, EOS could be sampled where transformers suppresses it."""
    return SamplingParams(max_new_tokens=n, min_new_tokens=n)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll `condition` until it holds; fail the test after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def padded_in_use(runner, *args, **kwargs):
    """A padded decode path (engine/runner/graphs/setup.py) built over `runner` and handed to
    it, as start-up does, without its check."""
    from engine.runner.graphs.setup import build_padded_decode

    padded = build_padded_decode(runner, *args, **kwargs)
    runner.use_padded_decode(padded)
    return padded


def piecewise_in_use(runner, *args, **kwargs):
    """A piecewise path built over `runner` and handed to it, as start-up does."""
    from engine.runner.graphs.setup import build_piecewise

    piecewise = build_piecewise(runner, *args, **kwargs)
    runner.use_piecewise(piecewise)
    return piecewise

