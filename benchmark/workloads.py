"""Benchmark workloads: what each request asks for.

Three sources: the LMI study's three prompts (the default), a synthetic workload with prompt
and output lengths drawn from distributions, and a JSONL file of prompts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Job:
    """One request of a workload: prompt text and exact output length (ignore EOS)."""

    prompt: str
    new_tokens: int

    def body(self, *, stream: bool) -> dict:
        params = {"max_new_tokens": self.new_tokens, "min_new_tokens": self.new_tokens,
                  "ignore_eos": True, "details": True}
        return {"inputs": self.prompt, "parameters": params, "stream": stream}


# The LMI batching study's three prompts (SageMaker example notebook "llama2-7b-batching-
# throughput"); continuous and PagedAttention runs ask min = max new tokens = 64 / 256 / 128.
# The notebook's third prompt is shown only in part; its ending here is ours.
LMI_WORKLOAD = (
    Job("The diamondback terrapin or simply terrapin is a species of turtle native to the "
        "brackish coastal tidal marshes of the", 64),
    Job("Write a program to add two numbers in python", 256),
    Job("Generate a list of ten titles for my book. The book is about my journey of travel "
        "to a remote village in the hills", 128),
)


def lmi_jobs(num_requests: int) -> list[Job]:
    """The study's prompts in turn, as awscurl's --dataset cycles through them."""
    return [LMI_WORKLOAD[i % len(LMI_WORKLOAD)] for i in range(num_requests)]


MAX_LENGTH = 1_000_000  # tokens: longer than any model's context, short of exhausting memory


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution: `N`, `uniform:LO:HI` or `normal:MEAN:STD` (at least 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, what: str) -> Lengths:
        name, *numbers = text.split(":")
        try:
            if not numbers and 1 <= float(name) <= MAX_LENGTH:
                return cls("fixed", float(int(float(name))))
            first, second = (float(v) for v in numbers)
        except (ValueError, OverflowError):  # "inf" passes float() but not int()
            first = second = -1.0
        if not math.isfinite(first + second) or max(first, second) > MAX_LENGTH:
            first = second = -1.0
        if name == "uniform" and 1 <= first <= second:
            return cls(name, first, second)
        if name == "normal" and first >= 1 and second >= 0:
            return cls(name, first, second)
        raise ValueError(f"{what}: expected N, uniform:LO:HI (1 <= LO <= HI) or "
                         f"normal:MEAN:STD (MEAN >= 1), lengths up to {MAX_LENGTH:,}, got "
                         f"{text!r}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        return {"fixed": f"{int(self.a)}", "uniform": f"uniform:{int(self.a)}:{int(self.b)}",
                "normal": f"normal:{self.a:g}:{self.b:g}"}[self.kind]


# Used when no tokenizer is at hand (an endpoint target): roughly one token each.
_WORDS = ("the river stone light market garden winter paper signal forest harbor engine "
          "window silver motion letter island summer number bridge orange planet meadow "
          "lantern copper valley thunder canvas ribbon").split()


def word_pool(tokenizer: Any | None) -> list[str]:
    """Words that are one token each after a space, so N words make an N-token prompt."""
    if tokenizer is None:
        return list(_WORDS)
    words = []
    for piece in tokenizer.get_vocab():
        word = piece[1:]
        if piece[:1] in ("Ġ", "▁") and word.isascii() and word.isalpha() and len(word) > 2:
            words.append(word)
    words = [w for w in sorted(words) if len(tokenizer.encode(" " + w,
                                                              add_special_tokens=False)) == 1]
    return words or list(_WORDS)


def synthetic_jobs(num_requests: int, prompt_lengths: Lengths, output_lengths: Lengths,
                   seed: int = 0, tokenizer: Any | None = None) -> list[Job]:
    """Random-word prompts of the drawn lengths (exact with the model's tokenizer, counting the
    special tokens such as BOS that encoding adds, as the server's does)."""
    rng = random.Random(seed)
    pool = word_pool(tokenizer)
    special = 0 if tokenizer is None else (len(tokenizer.encode(" " + pool[0]))
                                           - len(tokenizer.encode(" " + pool[0],
                                                                  add_special_tokens=False)))
    jobs = []
    for _ in range(num_requests):
        words = rng.choices(pool, k=max(1, prompt_lengths.sample(rng) - special))
        jobs.append(Job(" " + " ".join(words), output_lengths.sample(rng)))
    return jobs


def jsonl_jobs(path: Path, num_requests: int, output_lengths: Lengths, seed: int = 0
               ) -> list[Job]:
    """Prompts from a JSONL file, cycled to `num_requests`.

    Each line is a JSON object with the prompt under "inputs", "prompt" or "text" and, optionally,
    its output length under "max_new_tokens" (else drawn from `output_lengths`).
    """
    rng = random.Random(seed)
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            rows.append(_jsonl_row(line, number, path, output_lengths, rng))
    if not rows:
        raise ValueError(f"{path}: no prompts (one JSON object per line)")
    return [rows[i % len(rows)] for i in range(num_requests)]


def _jsonl_row(line: str, number: int, path: Path, output_lengths: Lengths,
               rng: random.Random) -> Job:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg})") from err
    prompt = next((row[k] for k in ("inputs", "prompt", "text")
                   if isinstance(row, dict) and k in row), None)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: needs a non-empty string under inputs, prompt or text")
    new_tokens = row.get("max_new_tokens", row.get("parameters", {}).get("max_new_tokens"))
    if new_tokens is None:
        new_tokens = output_lengths.sample(rng)
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ValueError(f"{where}: max_new_tokens must be an integer >= 1")
    return Job(prompt, new_tokens)
