"""Batch-1 decode speed: batchyard's engine vs transformers `generate`, same model, same prompt.

Decode tokens/s excludes the prefill: (n - 1) tokens over the time from the first sampled token
to the last. Both run greedy in the same process, one after the other, on the same threads.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmark.workloads import LMI_WORKLOAD


@dataclass
class DecodeReport:
    new_tokens: int
    batchyard_tokens_per_s: float
    transformers_tokens_per_s: float
    same_tokens: bool

    @property
    def ratio(self) -> float:
        return self.batchyard_tokens_per_s / self.transformers_tokens_per_s


def batchyard_decode(model_dir: Path, prompt_ids: list[int], new_tokens: int,
                     dtype: str) -> tuple[float, list[int]]:
    """(decode tokens/s, tokens) of one request alone on the `none` strategy."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(model=str(model_dir), batching="none", dtype=dtype,
                          max_model_len=len(prompt_ids) + new_tokens)
    engine = LLMEngine.from_config(config)
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            ignore_eos=True)
    engine.add_request("warmup", prompt_ids, params)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("timed", prompt_ids, params)
    times, tokens = [], []
    while engine.has_unfinished():
        for event in engine.step():
            if event.token_id is not None:
                times.append(time.perf_counter())
                tokens.append(event.token_id)
    return (len(times) - 1) / (times[-1] - times[0]), tokens


def transformers_decode(model_dir: Path, prompt_ids: list[int], new_tokens: int,
                        dtype: str) -> tuple[float, list[int]]:
    """(decode tokens/s, tokens) of plain `generate`, timing each token with a streamer."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    ids = torch.tensor([prompt_ids])
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False,
              "max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
              "eos_token_id": None, "pad_token_id": 0}
    rates = []
    for _ in range(2):  # the first run warms up
        clock = Clock()
        with torch.inference_mode():
            out = model.generate(ids, streamer=clock, **kwargs)
        first, last = clock.times[1], clock.times[-1]  # times[0] is the prompt itself
        rates.append((len(clock.times) - 2) / (last - first))
    return statistics.median(rates[1:]), out[0, len(prompt_ids):].tolist()


def run_decode(model_dir: Path, new_tokens: int = 128, dtype: str = "float32") -> DecodeReport:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompt_ids = tokenizer.encode(LMI_WORKLOAD[0].prompt)
    ours, our_tokens = batchyard_decode(model_dir, prompt_ids, new_tokens, dtype)
    theirs, their_tokens = transformers_decode(model_dir, prompt_ids, new_tokens, dtype)
    return DecodeReport(new_tokens, ours, theirs, our_tokens == their_tokens)
