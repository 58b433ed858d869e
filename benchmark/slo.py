"""SLO attainment and goodput (DistServe, OSDI '24), as pure functions of what the client saw.

A request meets the SLOs when its time to first token (TTFT) and its time per output token
(TPOT: (e2e - TTFT) / (output tokens - 1), the request's mean) are both within bounds; a request
with a single output token has no TPOT and meets that SLO trivially; a failed request meets
neither. SLO attainment at a request rate is the share of all requests sent at that rate that
met both. Goodput is the highest rate at which attainment reaches the target (90 % by default)
*and at every lower rate measured* (see `goodput`). vLLM's per-run "request goodput" (requests
meeting every SLO / run duration) is reported beside it. Nothing here needs a server, so the
rules are unit-tested on made-up results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from benchmark.loadgen import percentiles
from benchmark.targets import RequestResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SLO:
    """Bounds in seconds and the share of requests that must meet both."""

    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError("the TTFT and TPOT SLOs must be > 0 ms")
        if not 0 < self.attainment <= 1:
            raise ValueError("the attainment target must be in (0, 1], e.g. 0.9")


def ttft(result: RequestResult) -> float | None:
    """Seconds from when the request was due to its first token; None without one."""
    return result.token_times[0] - result.start if result.token_times else None


def tpot(result: RequestResult) -> float | None:
    """The request's mean seconds per output token after the first; None with < 2 tokens."""
    first = ttft(result)
    if first is None or result.num_output_tokens < 2:
        return None
    return (result.end - result.start - first) / (result.num_output_tokens - 1)


def meets(result: RequestResult, slo: SLO) -> tuple[bool, bool]:
    """(TTFT met, TPOT met); a failed request, or one without a first token, meets neither."""
    first = ttft(result)
    if not result.ok or first is None:
        return False, False
    per_token = tpot(result)
    return first <= slo.ttft_s, per_token is None or per_token <= slo.tpot_s


def rate_summary(rate: float, results: list[RequestResult], duration_s: float,
                 slo: SLO) -> dict:
    """What one rate's run achieved: attainment, each SLO's share, latency percentiles (ms),
    vLLM's request goodput (requests meeting both / run duration) and errors."""
    checks = [meets(r, slo) for r in results]
    both = sum(a and b for a, b in checks)
    n = max(1, len(results))
    done = [r for r in results if r.ok]
    first = percentiles([t for r in done if (t := ttft(r)) is not None])
    per_token = percentiles([t for r in done if (t := tpot(r)) is not None])
    return {
        "rate": rate, "requests": len(results), "errors": len(results) - len(done),
        "duration_s": round(duration_s, 3),
        "attainment": round(both / n, 4) if results else 0.0,
        "ttft_met": round(sum(a for a, _ in checks) / n, 4) if results else 0.0,
        "tpot_met": round(sum(b for _, b in checks) / n, 4) if results else 0.0,
        "ttft_p50_ms": _ms(first.get("p50")), "ttft_p90_ms": _ms(first.get("p90")),
        "tpot_p50_ms": _ms(per_token.get("p50")), "tpot_p90_ms": _ms(per_token.get("p90")),
        "requests_per_s": round(len(done) / duration_s, 4) if duration_s > 0 else 0.0,
        "request_goodput": round(both / duration_s, 4) if duration_s > 0 else 0.0,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def goodput(points: list[tuple[float, float]], target: float) -> float | None:
    """The highest rate whose attainment is >= `target` at it and at every lower measured rate
    (the curve's first crossing), from (rate, attainment) points in any order; None when the
    lowest rate already misses. A rate that passes above a failing one is noise or a warm-up
    artefact, not capacity: a server that misses at 2 req/s cannot promise 4."""
    best = None
    for rate, attained in sorted(points):
        if attained < target:
            break
        best = rate
    return best


def highest_passing(points: list[tuple[float, float]], target: float) -> float | None:
    """The highest rate meeting `target` regardless of lower rates (differs from `goodput`
    only on a non-monotonic curve, which the report then flags)."""
    return max((rate for rate, attained in points if attained >= target), default=None)


def search_rates(measure: Callable[[float], float], target: float, *, start: float = 0.5,
                 max_rate: float = 64.0, bisect_steps: int = 2) -> list[tuple[float, float]]:
    """Find the crossing with few runs: measure `start`, double while attainment holds (up to
    `max_rate`), then bisect `bisect_steps` times between the highest passing rate (0 when
    even `start` fails) and the lowest failing one. Returns the (rate, attainment) points in
    the order measured; `goodput` of them is the answer, within (hi - lo) / 2**steps."""
    if not 0 < start <= max_rate:
        raise ValueError("the search needs 0 < start rate <= max rate")
    points: list[tuple[float, float]] = []
    low, high, rate = 0.0, None, start
    while rate <= max_rate:
        attained = measure(rate)
        points.append((rate, attained))
        if attained < target:
            high = rate
            break
        low, rate = rate, rate * 2
    if high is None:  # held up to max_rate: goodput is at least that
        return points
    for _ in range(bisect_steps):
        rate = round((low + high) / 2, 4)
        attained = measure(rate)
        points.append((rate, attained))
        if attained >= target:
            low = rate
        else:
            high = rate
    return points


def goodput_text(value: float | None, points: list[tuple[float, float]]) -> str:
    """The goodput in words: a rate, "below the lowest rate (R req/s)", or ">= R" when even
    the highest rate measured held (the true goodput may be higher)."""
    if not points:
        return "not measured"
    if value is None:
        return f"below the lowest rate ({min(r for r, _ in points):g} req/s)"
    if value == max(r for r, _ in points):
        return f">= {value:g} req/s (held at every rate measured)"
    return f"{value:g} req/s"
