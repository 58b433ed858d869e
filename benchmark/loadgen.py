"""Closed-loop load generator against a running batchyard (or any LMI-schema) endpoint.

C clients each send their next request as soon as the previous one is answered, until N
requests are done (the LMI study's awscurl method). Streaming requests time every token, so the
report has TTFT and inter-token latency besides end-to-end latency.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import requests
from tqdm import tqdm

from benchmark.server_metrics import ServerSnapshot, scrape
from benchmark.workloads import Job

logger = logging.getLogger(__name__)


@dataclass
class RequestResult:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    ok: bool
    start: float
    end: float
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    status: int = 0
    error: str = ""
    num_prompt_tokens: int = 0


class HTTPTarget:
    """POST /invocations over one keep-alive session per client thread."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._local = threading.local()

    def send(self, job: Job, stream: bool,
             on_token: Callable[[int], None] | None = None) -> RequestResult:
        """One request; `on_token(n)` is called as the n-th streamed token arrives."""
        session = getattr(self._local, "session", None) or requests.Session()
        self._local.session = session
        start = time.perf_counter()
        try:
            r = session.post(f"{self.url}/invocations", json=job.body(stream),
                             stream=stream, timeout=self.timeout)
            if r.status_code != 200:
                return RequestResult(False, start, time.perf_counter(), status=r.status_code,
                                     error=r.text[:200])
            return _read_stream(r, start, on_token) if stream else _read_json(r, start)
        except (requests.RequestException, ValueError) as err:
            return RequestResult(False, start, time.perf_counter(), error=str(err)[:200])


def _read_json(r: requests.Response, start: float) -> RequestResult:
    body = r.json()
    end = time.perf_counter()
    details = body.get("details", {})
    return RequestResult(True, start, end, [], details.get("generated_tokens", 0), 200,
                         num_prompt_tokens=details.get("inputs", 0))


def _read_stream(r: requests.Response, start: float,
                 on_token: Callable[[int], None] | None) -> RequestResult:
    times: list[float] = []
    last: dict = {}
    for line in r.iter_lines():
        if not line:
            continue
        last = json.loads(line.removeprefix(b"data: "))
        if "token" in last:
            times.append(time.perf_counter())
            if on_token is not None:
                on_token(len(times))
    details = last.get("details", {})
    ok = details.get("finish_reason") in ("length", "eos_token", "stop_sequence")
    return RequestResult(ok, start, time.perf_counter(), times, len(times), 200,
                         "" if ok else str(last)[:200], details.get("inputs", 0))


@dataclass
class LoadReport:
    """What one load run measured (latencies in seconds)."""

    concurrency: int
    num_requests: int
    num_errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft: dict[str, float]
    inter_token: dict[str, float]
    e2e: dict[str, float]
    server: dict[str, float]
    errors: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def table(self) -> str:
        rows = [("requests/s", f"{self.requests_per_s:.3f}"),
                ("output tokens/s", f"{self.output_tokens_per_s:.1f}"),
                ("requests (errors)", f"{self.num_requests} ({self.num_errors})"),
                ("duration", f"{self.duration_s:.1f} s")]
        for name, stats in (("TTFT", self.ttft), ("inter-token", self.inter_token),
                            ("end-to-end", self.e2e)):
            rows.append((f"{name} p50/p90/p99 ms", "/".join(
                f"{stats.get(p, float('nan')) * 1000:.0f}" for p in ("p50", "p90", "p99"))))
        rows += [(f"server {k}", f"{v:.2f}") for k, v in self.server.items()]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_load(target: HTTPTarget, jobs: list[Job], concurrency: int, stream: bool = True,
             metrics_url: str | None = None, progress: bool = True) -> LoadReport:
    """Send `jobs` with `concurrency` clients in a closed loop; summarize what came back."""
    before = scrape(metrics_url) if metrics_url else None
    pending = iter(list(enumerate(jobs)))
    lock = threading.Lock()
    results: list[RequestResult | None] = [None] * len(jobs)
    bar = tqdm(total=len(jobs), unit="req", disable=not progress, desc="requests")

    def client() -> None:
        while True:
            with lock:
                item = next(pending, None)
            if item is None:
                return
            i, job = item
            results[i] = target.send(job, stream)
            bar.update(1)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    duration = time.perf_counter() - started
    bar.close()
    after = scrape(metrics_url) if metrics_url else None
    return summarize([r for r in results if r is not None], concurrency, duration,
                     before.delta(after) if before and after else {})


def summarize(results: list[RequestResult], concurrency: int, duration: float,
              server: dict[str, float]) -> LoadReport:
    done = [r for r in results if r.ok]
    ttft = [r.token_times[0] - r.start for r in done if r.token_times]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    tokens = sum(r.num_output_tokens for r in done)
    return LoadReport(
        concurrency=concurrency, num_requests=len(results), num_errors=len(results) - len(done),
        duration_s=duration, requests_per_s=len(done) / duration,
        output_tokens_per_s=tokens / duration, ttft=percentiles(ttft),
        inter_token=percentiles(itl), e2e=percentiles([r.end - r.start for r in done]),
        server=server, errors=sorted({r.error or str(r.status) for r in results if not r.ok}))


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99 by nearest rank (the smallest value with at least p % of the values at or
    below it) and the mean; empty when there are no values."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(p: int) -> float:
        return ordered[max(0, math.ceil(p * len(ordered) / 100) - 1)]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99),
            "mean": sum(ordered) / len(ordered)}


def wait_ready(url: str, timeout: float) -> None:
    """Poll GET /ping until it answers 200; raise TimeoutError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if requests.get(f"{url.rstrip('/')}/ping", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}/ping did not answer 200 within {timeout:.0f} s")


__all__ = ["HTTPTarget", "LoadReport", "RequestResult", "ServerSnapshot", "percentiles",
           "run_load", "summarize", "wait_ready"]
