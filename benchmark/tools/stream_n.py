"""A closed loop of C clients streaming /v1/completions with n sampled choices of 64 tokens
each, against a running server; prints req/s and the server's CPU per output token (its HTTP
worker and engine core, from measure.py's /proc walk).

    python -m benchmark.tools.stream_n PORT N CLIENTS REQUESTS

Written for the n-choices run (docs/benchmark/cpu-2026-11-27-n-choices/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from benchmark.tools import measure

NEW_TOKENS = 64


def request_bytes(n: int) -> bytes:
    body = json.dumps({"prompt": "Once upon a time there was", "max_tokens": NEW_TOKENS,
                       "n": n, "temperature": 0.8, "seed": 1, "ignore_eos": True,
                       "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)


async def one(port: int, request: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data.count(b'"text"')


async def run(port: int, n: int, clients: int, total: int) -> None:
    request = request_bytes(n)
    await asyncio.gather(*[one(port, request) for _ in range(clients)])  # warm-up, not timed
    todo, chunks = iter(range(total)), []

    async def client() -> None:
        for _ in todo:
            chunks.append(await one(port, request))
    http0, core0 = measure.cpu_seconds(port)
    start = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    elapsed = time.perf_counter() - start
    http1, core1 = measure.cpu_seconds(port)
    tokens = total * n * NEW_TOKENS
    print(f"{total / elapsed:.1f} req/s, {tokens / elapsed:.0f} tokens/s, http "
          f"{(http1 - http0) / tokens * 1e6:.1f} us/token, core "
          f"{(core1 - core0) / tokens * 1e6:.1f} us/token, chunks per request "
          f"{sum(chunks) / len(chunks):.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.stream_n",
                                     description=__doc__.splitlines()[0])
    for name, what in (("port", "the running server's port on 127.0.0.1"),
                       ("n", "choices per request"), ("clients", "clients in the closed loop"),
                       ("requests", "timed requests")):
        parser.add_argument(name, type=int, help=what)
    args = parser.parse_args()
    asyncio.run(run(args.port, args.n, args.clients, args.requests))
