"""A closed loop of C streaming clients on asyncio streams: one HTTP/1.1 request per connection,
the body read until the server closes. It needs ~13 % of a vCPU for 32 streams (~20 % at ~600
req/s on the AVX-512 host, docs/benchmark/cpu-2026-11-27-core-pipes/) where
`batchyard bench load` (requests, a thread per client, every line parsed) needs 60-70 %, so
on a 2-vCPU host it leaves the server most of its CPU. Prints req/s, mean time to the first token's
bytes (read until the first `"token"` arrives, not only the first byte: a server may send its
headers first) and mean first token -> end. `--wake-at-end`: after the first token the client
is woken only by the end of the body (it still reads all of it), about what clients on other
machines cost this host (docs/benchmark/cpu-2026-11-27-core-pipes/). `--no-stream`: one JSON
body per request, as the LMI study's clients asked (docs/benchmark/cpu-2026-11-27-unstreamed/).
`--keep-alive` (streams only): each client sends its requests over one kept connection, reading
each body to its last chunk (docs/benchmark/cpu-2026-11-27-core-overhead/).

    python -m benchmark.tools.raw_client --port 8080 --model-dir /tmp/tiny320 -n 960

Written for the served-gap run (docs/benchmark/cpu-2026-11-25-served-gap/); every later
served / offline run on the tiny model uses it, most through benchmark.tools.measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time

from transformers import AutoTokenizer

from benchmark.workloads import Lengths, synthetic_jobs

# SO_RCVLOWAT for --wake-at-end: more than any body here, under half the receive buffer (the
# kernel caps it there); the server's FIN wakes the reader whatever the low mark.
WAKE_AT_END_BYTES = 1 << 15


LAST_CHUNK = b"\r\n0\r\n\r\n"  # a chunked body's end


async def one(port: int, body: bytes, times: list[tuple[float, float]],
              wake_at_end: bool = False, stream: bool = True,
              kept: list | None = None) -> int:
    """One request; `kept` (a list per client): reuse the connection it holds, or keep the new
    one there, and read the streamed body to its last chunk instead of to the server's close."""
    start = time.perf_counter()
    if kept:
        reader, writer = kept
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if kept is not None:
            kept += [reader, writer]
    close = b"" if kept is not None else b"Connection: close\r\n"
    writer.write(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n%b\r\n" % (len(body), close) + body)
    await writer.drain()
    if not stream:  # one JSON body at the end: its details list each token's "id"
        data = await reader.read()
        writer.close()
        times.append((time.perf_counter() - start, 0.0))
        return data.count(b'"id"')
    data = b""
    while b'"token"' not in data:
        more = await reader.read(65536)
        if not more:
            break
        data += more
    first_at = time.perf_counter()
    if wake_at_end:  # woken by the end of the body only (its FIN), not by every token's bytes
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT,
                                                   WAKE_AT_END_BYTES)
    if kept is not None:
        while not data.endswith(LAST_CHUNK):
            more = await reader.read(65536)
            if not more:
                raise ConnectionError("the server closed a kept connection mid-body")
            data += more
    else:
        data += await reader.read()
        writer.close()
    times.append((first_at - start, time.perf_counter() - first_at))
    return data.count(b'"token"')


async def run(port: int, bodies: list[bytes], clients: int, wake_at_end: bool,
              stream: bool, keep_alive: bool) -> None:
    times: list[tuple[float, float]] = []
    await asyncio.gather(*[one(port, b, [], stream=stream)
                           for b in bodies[:clients]])  # warm-up, not timed
    todo = iter(bodies[clients:])
    counts: list[int] = []

    async def client() -> None:
        kept: list | None = [] if keep_alive else None
        for body in todo:
            counts.append(await one(port, body, times, wake_at_end, stream, kept))
    start = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    elapsed = time.perf_counter() - start
    print(f"{len(counts) / elapsed:.1f} req/s; tokens per request {min(counts)}-{max(counts)}; "
          f"first token {statistics.mean(a for a, _ in times) * 1e3:.1f} ms, first token -> end "
          f"{statistics.mean(b for _, b in times) * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tools.raw_client",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("-n", type=int, default=960)
    parser.add_argument("-c", type=int, default=32)
    parser.add_argument("--prompt-tokens", default="24")
    parser.add_argument("--output-tokens", default="64")
    parser.add_argument("--wake-at-end", action="store_true",
                        help="after the first token, be woken only by the end of the body "
                        "(SO_RCVLOWAT): about the CPU of clients on other machines")
    parser.add_argument("--no-stream", action="store_true",
                        help="ask for one JSON body per request (\"stream\": false; its "
                        "first-token time is then the whole request's)")
    parser.add_argument("--keep-alive", action="store_true",
                        help="streams over one kept connection per client")
    args = parser.parse_args()
    if args.keep_alive and (args.no_stream or args.wake_at_end):
        parser.error("--keep-alive reads streams whole: not with --no-stream or --wake-at-end")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    jobs = synthetic_jobs(args.n + args.c, Lengths.parse(args.prompt_tokens, "prompt"),
                          Lengths.parse(args.output_tokens, "output"), 0, tokenizer)
    bodies = [json.dumps(job.body(stream=not args.no_stream)).encode() for job in jobs]
    asyncio.run(run(args.port, bodies, args.c, args.wake_at_end, not args.no_stream,
                    args.keep_alive))


if __name__ == "__main__":
    main()
