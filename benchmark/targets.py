"""Where the load goes: a server's HTTP address, or a SageMaker endpoint through boto3.

Both send the LMI request body and time every streamed token, so the same report (TTFT,
inter-token latency, end-to-end latency) comes out of either.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import requests

from benchmark.workloads import Job
from deploy.jsonlines import JsonLinesSplitter

FINISHED = ("length", "eos_token", "stop_sequence")


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


class Target(Protocol):
    def send(self, job: Job, *, stream: bool, start: float | None = None,
             on_token: Callable[[int], None] | None = None) -> RequestResult:
        """One request; `start` (perf_counter) backdates it to when it was due to be sent;
        `on_token(n)` is called as the n-th streamed token arrives."""
        ...


class HTTPTarget:
    """POST /invocations over one keep-alive session per client thread."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._local = threading.local()

    def send(self, job: Job, *, stream: bool, start: float | None = None,
             on_token: Callable[[int], None] | None = None) -> RequestResult:
        session = getattr(self._local, "session", None) or requests.Session()
        self._local.session = session
        start = time.perf_counter() if start is None else start
        try:
            r = session.post(f"{self.url}/invocations", json=job.body(stream=stream),
                             stream=stream, timeout=self.timeout)
            if r.status_code != 200:
                return RequestResult(ok=False, start=start, end=time.perf_counter(),
                                     status=r.status_code,
                                     error=r.text[:200])
            if stream:
                return stream_result(start, _lines_as_chunks(r.iter_lines()), on_token)
            return json_result(start, r.json())
        except (requests.RequestException, ValueError) as err:
            return RequestResult(ok=False, start=start, end=time.perf_counter(),
                                 error=str(err)[:200])


class SageMakerTarget:
    """`invoke_endpoint` / `invoke_endpoint_with_response_stream` on a SageMaker endpoint.

    `endpoint_url` points the runtime client elsewhere (a local batchyard server answers the
    same paths); without credentials there, requests go unsigned.
    """

    def __init__(self, endpoint_name: str, region: str | None = None,
                 endpoint_url: str | None = None, max_connections: int = 64,
                 timeout: float = 70.0) -> None:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        session = boto3.Session(region_name=region or None)
        # One attempt: a throttled or failed request is a result the report must show.
        config = Config(retries={"mode": "standard", "max_attempts": 1}, read_timeout=timeout,
                        max_pool_connections=max_connections,
                        user_agent_extra="batchyard-bench")
        if endpoint_url and session.get_credentials() is None:
            config = config.merge(Config(signature_version=UNSIGNED))
        if not session.region_name and not endpoint_url:
            raise ValueError("no AWS region for the endpoint: pass --region or set "
                             "AWS_DEFAULT_REGION")
        self.endpoint_name = endpoint_name
        # A local endpoint_url answers in any region; boto3 still needs one to sign.
        self.client = session.client("sagemaker-runtime", endpoint_url=endpoint_url,
                                     region_name=session.region_name or "us-east-1",
                                     config=config)

    def send(self, job: Job, *, stream: bool, start: float | None = None,
             on_token: Callable[[int], None] | None = None) -> RequestResult:
        from botocore.exceptions import BotoCoreError, ClientError

        start = time.perf_counter() if start is None else start
        body = json.dumps(job.body(stream=stream)).encode()
        try:
            if stream:
                response = self.client.invoke_endpoint_with_response_stream(
                    EndpointName=self.endpoint_name, ContentType="application/json",
                    Accept="application/jsonlines", Body=body)
                return stream_result(start, _payload_parts(response["Body"]), on_token)
            response = self.client.invoke_endpoint(
                EndpointName=self.endpoint_name, ContentType="application/json",
                Accept="application/json", Body=body)
            return json_result(start, json.loads(response["Body"].read()))
        except ClientError as err:
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return RequestResult(ok=False, start=start, end=time.perf_counter(), status=status,
                                 error=str(err)[:200])
        except (BotoCoreError, ValueError) as err:
            return RequestResult(ok=False, start=start, end=time.perf_counter(),
                                 error=str(err)[:200])


def _payload_parts(events: Iterable[dict[str, Any]]) -> Iterable[bytes]:
    for event in events:
        if "PayloadPart" not in event:
            raise ValueError(f"the stream failed: {str(event)[:150]}")
        yield event["PayloadPart"].get("Bytes", b"")


def _lines_as_chunks(lines: Iterable[bytes]) -> Iterable[bytes]:
    for line in lines:
        yield line + b"\n"


def json_result(start: float, body: Any) -> RequestResult:
    end = time.perf_counter()
    answer = body[0] if isinstance(body, list) and body else body
    details = answer.get("details") if isinstance(answer, dict) else None
    details = details if isinstance(details, dict) else {}
    return RequestResult(ok=True, start=start, end=end,
                         num_output_tokens=details.get("generated_tokens", 0), status=200,
                         num_prompt_tokens=details.get("inputs", 0))


def stream_result(start: float, chunks: Iterable[bytes],
                  on_token: Callable[[int], None] | None = None) -> RequestResult:
    """Token lines (JSON, or SSE `data:` lines) in chunks that need not end at line ends;
    a token's time is its chunk's arrival."""
    splitter = JsonLinesSplitter()
    times: list[float] = []
    last: dict = {}
    for chunk in chunks:  # a line that is not JSON raises StreamLineError, a ValueError
        for last in splitter.feed(chunk):
            if "token" in last:
                times.append(time.perf_counter())
                if on_token is not None:
                    on_token(len(times))
    last = (splitter.close() or [last])[-1]
    details = last.get("details")
    details = details if isinstance(details, dict) else {}
    ok = details.get("finish_reason") in FINISHED
    return RequestResult(ok=ok, start=start, end=time.perf_counter(), token_times=times,
                         num_output_tokens=len(times), status=200,
                         error="" if ok else str(last)[:200],
                         num_prompt_tokens=details.get("inputs", 0))
