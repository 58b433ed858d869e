"""Load generator against a running batchyard (or any LMI-schema) endpoint.

By default C clients each send their next request as soon as the previous one is answered,
until N requests are done (the LMI study's awscurl method); Poisson arrivals and a duration are
the alternatives. Streaming requests time every token, so the report has TTFT and inter-token
latency besides end-to-end latency.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import requests
from tqdm import tqdm

from benchmark.server_metrics import ServerSnapshot, scrape
from benchmark.targets import HTTPTarget, RequestResult, SageMakerTarget, Target
from benchmark.workloads import Job

logger = logging.getLogger(__name__)
# Above this many cores of its own CPU, a load run says that the generator may be what limits it.
CLIENT_CPU_WARNING = 0.5


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
    mean_prompt_tokens: float = 0.0  # as the server counted them (0 when it does not say)
    mean_output_tokens: float = 0.0
    # Raw seconds behind the percentiles, for CDFs: per request (e2e, ttft), per gap (inter_token).
    samples: dict[str, list[float]] = field(default_factory=dict)
    # This load generator's CPU seconds per second of the run: on a host it shares with the
    # server, that much CPU was the server's loss.
    client_cpu_cores: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def table(self) -> str:
        rows = [("requests/s", f"{self.requests_per_s:.3f}"),
                ("output tokens/s", f"{self.output_tokens_per_s:.1f}"),
                ("requests (errors)", f"{self.num_requests} ({self.num_errors})"),
                ("duration", f"{self.duration_s:.1f} s"),
                ("client CPU", f"{self.client_cpu_cores:.2f} cores")]
        for name, stats in (("TTFT", self.ttft), ("inter-token", self.inter_token),
                            ("end-to-end", self.e2e)):
            rows.append((f"{name} p50/p90/p99 ms", "/".join(
                f"{stats.get(p, float('nan')) * 1000:.0f}" for p in ("p50", "p90", "p99"))))
        rows += [(f"server {k}", f"{v:.2f}") for k, v in self.server.items()]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@dataclass(frozen=True)
class LoadPlan:
    """How the load is sent: `concurrency` clients in a closed loop (each sends its next request
    when the previous one is answered), or Poisson arrivals at `request_rate` per second with at
    most `concurrency` in flight. It stops after `num_requests`, or after `duration_s` seconds
    (requests in flight then are still waited for), whichever comes first."""

    concurrency: int = 32
    num_requests: int | None = 96
    duration_s: float | None = None
    request_rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give a number of requests or a duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("the number of requests must be >= 1")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:
            raise ValueError("the duration must be > 0 seconds")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("request rate must be > 0 requests/s")

    def describe(self) -> str:
        mode = (f"Poisson arrivals at {self.request_rate:g} req/s, at most {self.concurrency} in "
                f"flight (seed {self.seed})" if self.request_rate else
                f"closed loop, {self.concurrency} clients")
        stop = [f"{self.num_requests} requests"] if self.num_requests is not None else []
        stop += [f"{self.duration_s:g} s"] if self.duration_s is not None else []
        return f"{mode}, until {' or '.join(stop)}"


def run_load(target: Target, jobs: list[Job], plan: LoadPlan, *, stream: bool = True,
             metrics_url: str | None = None, progress: bool = True,
             warmup: bool = False) -> LoadReport:
    """Send `jobs` (cycled) as `plan` says; summarize what came back (`warmup`: a run whose
    figures nobody reads, so no warning about the client's CPU)."""
    before = _scrape(metrics_url)
    bar = tqdm(total=plan.num_requests, unit="req", disable=not progress, desc="requests")
    started, cpu_started = time.perf_counter(), time.process_time()
    deadline = started + plan.duration_s if plan.duration_s is not None else math.inf
    limit = plan.num_requests if plan.num_requests is not None else math.inf
    send = _poisson if plan.request_rate else _closed_loop
    results = send(target, jobs, plan, stream=stream, deadline=deadline, limit=limit, bar=bar)
    duration = time.perf_counter() - started
    client_cpu = (time.process_time() - cpu_started) / duration
    bar.close()
    if client_cpu > CLIENT_CPU_WARNING and not warmup:
        logger.warning("the load generator used %.2f CPU cores: where it shares the server's "
                       "host, that CPU is the server's loss (run it elsewhere or with fewer "
                       "clients to measure the server alone)", client_cpu)
    after = _scrape(metrics_url)
    report = summarize(results, plan.concurrency, duration,
                       before.delta(after) if before and after else {})
    report.client_cpu_cores = client_cpu
    return report


def _scrape(metrics_url: str | None) -> ServerSnapshot | None:
    """The server's metrics, or None (the report then has no server figures) if unreadable."""
    if not metrics_url:
        return None
    try:
        return scrape(metrics_url)
    except (requests.RequestException, ValueError) as err:
        logger.warning("no server metrics from %s: %s", metrics_url, err)
        return None


def _send(target: Target, job: Job, *, stream: bool, start: float | None = None) -> RequestResult:
    """A failed request whatever goes wrong in the client, so one request never ends the run."""
    begun = time.perf_counter() if start is None else start
    try:
        return target.send(job, stream=stream, start=begun)
    except Exception as err:  # noqa: BLE001 - reported in the result, counted as an error
        return RequestResult(ok=False, start=begun, end=time.perf_counter(),
                             error=f"{type(err).__name__}: {err}"[:200])


def _closed_loop(target: Target, jobs: list[Job], plan: LoadPlan, *, stream: bool,
                 deadline: float, limit: float, bar: tqdm) -> list[RequestResult]:
    lock = threading.Lock()
    results: list[RequestResult] = []
    sent = 0

    def client() -> None:
        nonlocal sent
        while True:
            with lock:
                if sent >= limit or time.perf_counter() >= deadline:
                    return
                job, sent = jobs[sent % len(jobs)], sent + 1
            result = _send(target, job, stream=stream)
            with lock:
                results.append(result)
            bar.update(1)

    with ThreadPoolExecutor(plan.concurrency) as pool:
        for future in [pool.submit(client) for _ in range(plan.concurrency)]:
            future.result()
    return results


def _poisson(target: Target, jobs: list[Job], plan: LoadPlan, *, stream: bool,
             deadline: float, limit: float, bar: tqdm) -> list[RequestResult]:
    """Open loop: a request's clock starts when it is due, so waiting for a free client (when
    `concurrency` are busy) counts in its latency rather than hiding it."""
    rng = random.Random(plan.seed)
    due = time.perf_counter()
    futures: list[Future[RequestResult]] = []

    def send(job: Job, at: float) -> RequestResult:
        result = _send(target, job, stream=stream, start=at)
        bar.update(1)
        return result

    with ThreadPoolExecutor(plan.concurrency) as pool:
        while len(futures) < limit:
            due += rng.expovariate(plan.request_rate or 1.0)
            if due >= deadline:
                break
            time.sleep(max(0.0, due - time.perf_counter()))
            futures.append(pool.submit(send, jobs[len(futures) % len(jobs)], due))
    return [f.result() for f in futures]


def summarize(results: list[RequestResult], concurrency: int, duration: float,
              server: dict[str, float]) -> LoadReport:
    done = [r for r in results if r.ok]
    ttft = [r.token_times[0] - r.start for r in done if r.token_times]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    e2e = [r.end - r.start for r in done]
    tokens = sum(r.num_output_tokens for r in done)
    return LoadReport(
        concurrency=concurrency, num_requests=len(results), num_errors=len(results) - len(done),
        duration_s=duration, requests_per_s=len(done) / duration,
        output_tokens_per_s=tokens / duration, ttft=percentiles(ttft),
        inter_token=percentiles(itl), e2e=percentiles(e2e),
        server=server, errors=sorted({r.error or str(r.status) for r in results if not r.ok}),
        mean_prompt_tokens=sum(r.num_prompt_tokens for r in done) / max(1, len(done)),
        mean_output_tokens=tokens / max(1, len(done)),
        samples={"e2e": _rounded(e2e), "ttft": _rounded(ttft), "inter_token": _rounded(itl)})


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 6) for v in values]


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


__all__ = ["HTTPTarget", "LoadPlan", "LoadReport", "RequestResult", "SageMakerTarget",
           "ServerSnapshot", "percentiles", "run_load", "summarize", "wait_ready"]
