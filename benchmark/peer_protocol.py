"""The protocol every peer speaks: its workload file, its closed loop and its result rows.

Standard library only: it is imported inside the vLLM virtualenv, by the transformers peers and
by batchyard's offline peer alike.

The workload file is {"requests": [{"prompt_ids": [...], "new_tokens": n}, ...]}. The requests
run in a closed loop at concurrency C in the given order (a new one starts as soon as one
finishes), greedy, EOS ignored but not banned (as batchyard's ignore_eos), after a warm-up that
is not timed. Times are time.perf_counter() seconds of the peer's process.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

FIRST_TOKENS = 16  # of the first request, kept to check that the peers agree
WARMUP_TOKENS = 2


def record(start: float, end: float, token_times: list[float], num_tokens: int, expected: int,
           error: str = "") -> dict:
    """One request's result; it is ok only with exactly the requested number of tokens."""
    if not error and num_tokens != expected:
        error = f"generated {num_tokens} tokens, asked for {expected}"
    return {"start": start, "end": end, "token_times": token_times,
            "num_output_tokens": num_tokens, "ok": not error, "error": error[:300]}


def warmup_requests(requests: list[dict], concurrency: int) -> list[dict]:
    """The first C prompts with a few tokens each: exercises batched prefill and decode."""
    return [{**r, "new_tokens": WARMUP_TOKENS} for r in requests[:concurrency]]


def closed_loop(requests: list[dict], concurrency: int, tag: str,
                add: Callable[[str, dict], None],
                step: Callable[[], list[tuple[str, list[int], bool, str]]]
                ) -> tuple[list[dict], list[int]]:
    """C requests in flight, the next added as soon as one finishes. `add(key, request)`
    submits one; `step()` runs the engine once and returns (key, new token ids, finished,
    error) per request it moved. A token's time is the return of the step that gave it."""
    pending = deque(enumerate(requests))
    live: dict[str, tuple[int, float, list[float], list[int]]] = {}
    results: list[dict | None] = [None] * len(requests)
    first: list[int] = []

    def submit() -> None:
        i, r = pending.popleft()
        live[f"{tag}{i}"] = (i, time.perf_counter(), [], [])
        add(f"{tag}{i}", r)

    while pending and len(live) < concurrency:
        submit()
    while live:
        updates = step()
        now = time.perf_counter()
        for key, new, finished, error in updates:
            i, start, times, tokens = live[key]
            times += [now] * len(new)
            tokens += new
            if finished:
                del live[key]
                results[i] = record(start, now, times, len(tokens), requests[i]["new_tokens"],
                                    error)
                first = tokens if i == 0 else first
                if pending:
                    submit()
    return [r for r in results if r is not None], first
