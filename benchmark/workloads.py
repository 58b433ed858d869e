"""Benchmark workloads: what each request asks for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    """One request of a workload: prompt text and exact output length (ignore EOS)."""

    prompt: str
    new_tokens: int

    def body(self, stream: bool) -> dict:
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
