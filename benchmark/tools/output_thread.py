"""The serving process's output thread, alone: per row (one sequence's token in one step), the
CPU of an /invocations stream written by that thread. 27 streams, 64 steps: each step's
CoreUpdate pickled as the core sends it, then what EngineLoop._emit does with it (unpickle,
step metrics, detokenize, dispatch, make the line, send it to a socket pair). Best of 15 rounds.

    python -m benchmark.tools.output_thread [ROWS]

Written for the http-cpu run (docs/benchmark/cpu-2026-11-26-http-cpu/); the core-overhead run
(docs/benchmark/cpu-2026-11-27-core-overhead/) used it again. It drives engine internals (the
output loop, the core's update records), so it follows their module paths.
"""

from __future__ import annotations

import argparse
import pickle
import random
import socket
import time

from transformers import AutoTokenizer

from engine import SamplingParams
from engine.core.engine_core import CoreUpdate
from engine.inputs import GenerationRequest
from engine.outputs import Gauges, StepStats
from engine.serving.loop import EngineLoop
from engine.text.output_processor import StepOutput
from handler.http.direct_stream import DirectWriter
from handler.http.generation import GenerateLines, _Written
from handler.http.metrics import Metrics
from handler.http.schemas import parse_generate

MODEL = "/tmp/tiny320"  # the tests' tiny Llama (tests.models_fixtures.build_tiny_model)
TOKENS = 64


class PickledCore:
    """The core's end of the pipe: the updates put here, as bytes."""

    initial_gauges = Gauges(alive=True, num_in_flight=0, num_waiting=0, num_running=0,
                            kv_blocks_used=0, kv_blocks_total=100, kv_block_size=16,
                            max_concurrency=32, prefix_cache_hit_rate=0.0)

    def __init__(self) -> None:
        self.pending: list[bytes] = []

    def receive(self) -> CoreUpdate:
        return pickle.loads(self.pending.pop(0))

    def has_update(self) -> bool:
        return bool(self.pending)

    def send(self, message) -> None:
        pass

    def is_alive(self) -> bool:
        return True


def one_round(tokenizer, metrics: Metrics, rows: int, token_ids: list[int]) -> float:
    """µs of the output thread per row, over one round of 64 steps."""
    core = PickledCore()
    loop = EngineLoop(core, tokenizer, 32, 100, on_step=metrics.on_step)
    handles, pairs = [], []
    gen = parse_generate({"inputs": "hello", "parameters": {"max_new_tokens": TOKENS},
                          "stream": True}, wants_stream=True)
    for _ in range(rows):
        request = GenerationRequest(tuple(range(5, 29)), SamplingParams(max_new_tokens=TOKENS))
        handle = loop.submit([request])[0]
        server, client = socket.socketpair()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        writer = DirectWriter(handle, server, GenerateLines(gen, lambda ids: "", False),
                              _Written(False).text)
        handle.on_delivery(writer._drive)
        handles.append(handle)
        pairs.append((server, client))
    blobs = []
    for t in range(TOKENS):
        outputs = [StepOutput(h.request_id, token_ids[t], -1.2345678 - t / 100, 24, t + 1,
                              "length" if t == TOKENS - 1 else None) for h in handles]
        stats = StepStats(rows, 0, rows, 0, rows, 50, 100, 0, 0.0006)
        blobs.append(pickle.dumps(CoreUpdate(outputs, loop._gauges, stats),
                                  pickle.HIGHEST_PROTOCOL))
    spent = 0.0
    for blob in blobs:
        core.pending.append(blob)
        start = time.perf_counter()
        updates, _ = loop._updates_here()  # EngineLoop._emit's loop body, once
        loop._gauges = updates[-1].gauges
        for update in updates:
            metrics.on_step(update.stats)
        loop._deliver([out for update in updates for out in update.outputs])
        spent += time.perf_counter() - start
        for _, client in pairs:
            client.recv(1 << 16)
    for server, client in pairs:
        server.close()
        client.close()
    return spent / (TOKENS * rows) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.output_thread",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="?", type=int, default=27,
                        help="streams, one row each per step (default 27)")
    rows = parser.parse_args().rows
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    metrics = Metrics()
    rng = random.Random(0)
    token_ids = [rng.randrange(3, 300) for _ in range(TOKENS)]
    best = min(one_round(tokenizer, metrics, rows, token_ids) for _ in range(15))
    print(f"{best:.2f} us per row")


if __name__ == "__main__":
    main()
