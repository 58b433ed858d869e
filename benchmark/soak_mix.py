"""The requests of `batchyard bench soak`: every route and shape at random, and how each is
sent (whole, hung up before the answer or mid-stream, huge or malformed)."""

from __future__ import annotations

import json
import random
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import requests

PROMPTS = [f"Once upon a time {i} the capital of France" for i in range(16)]
MAX_NEW = 32
MAX_REQUEST = 1024 * 1024  # the soak server's option.max_request_size
HANG_AFTER = 120.0  # seconds without an answer that make a hang
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
MALFORMED = [b'{"inputs": "a", "parameters": {', b"\xff\xfe\x00garbage", b"[]", b"null",
             b'{"inputs": 5}', b'{"messages": "hi"}', b'{"prompt": null, "max_tokens": -1}',
             b'{"inputs": "a", "parameters": {"max_new_tokens": 1e400}}',
             b'{"messages": [{"role": "user"}]}', b'{"inputs": "a", "unknown": 1}']


@dataclass
class Request:
    """One request: `kind` names its shape; `reference` is set when its greedy tokens must
    equal that prompt's answer alone."""

    kind: str
    route: str
    body: dict | bytes
    stream: bool = False
    headers: dict = field(default_factory=dict)
    reference: str | None = None
    max_new: int = 0

    def data(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()

    def describe(self) -> dict:
        data = self.data()
        return {"kind": self.kind, "route": self.route, "stream": self.stream,
                "headers": self.headers, "bytes": len(data),
                "body": data[:600].decode(errors="replace")}


def _guided(rng: random.Random) -> dict:
    """One of the vLLM / OpenAI structured-output fields."""
    return rng.choice([{"guided_json": SCHEMA}, {"guided_regex": "[a-z]{1,6}( [0-9]{1,3})?"},
                       {"guided_choice": ["Paris", "Tokyo", "Köln 🙂"]},
                       {"response_format": {"type": "json_object"}},
                       {"response_format": {"type": "json_schema", "json_schema": {
                           "name": "person", "schema": SCHEMA}}}])


def pick(rng: random.Random) -> Request:
    """A random well-formed request."""
    prompt = rng.choice(PROMPTS)
    new = rng.randint(1, MAX_NEW)
    stream = rng.random() < 0.4
    kind = rng.choice(["invocations", "invocations", "tgi", "guided", "messages", "chat",
                       "chat", "completions"])
    if kind == "invocations":  # greedy: its tokens must equal the prompt's answer alone
        return Request(kind, "/invocations", {"inputs": prompt, "stream": stream, "parameters": {
            "max_new_tokens": new, "ignore_eos": True, "details": True}}, stream,
            reference=prompt, max_new=new)
    if kind == "tgi":  # TGI's fields, its grammar, SSE
        params: dict = {"max_new_tokens": new, "details": True, "top_n_tokens": 2,
                        "truncate": 12, "do_sample": True, "seed": rng.randint(0, 99)}
        if not stream:
            params["decoder_input_details"] = True
        if rng.random() < 0.3:
            params["grammar"] = rng.choice([{"type": "json", "value": SCHEMA},
                                            {"type": "regex", "value": "[A-Z][a-z]{0,8}"}])
        headers = {"Accept": "text/event-stream"} if stream else {}
        return Request("tgi" + ("-grammar" if "grammar" in params else ""), "/invocations",
                       {"inputs": prompt, "parameters": params}, stream, headers)
    if kind == "guided":  # guided_* as /invocations parameters
        fields = _guided(rng)
        fields.pop("response_format", None)
        params = {"max_new_tokens": new, **(fields or {"guided_choice": ["yes", "no"]})}
        return Request("invocations-guided", "/invocations",
                       {"inputs": prompt, "stream": stream, "parameters": params}, stream)
    messages = [{"role": "user", "content": prompt}]
    extra = _guided(rng) if rng.random() < 0.3 else {}
    n = rng.choice([1, 1, 2, 3])
    common = {"max_tokens": new, "n": n, "stream": stream, **extra}
    suffix = ("-n" if n > 1 else "") + ("-guided" if extra else "")
    if kind == "messages":  # a chat body on /invocations
        return Request("invocations-chat" + suffix, "/invocations",
                       {"messages": messages, **common}, stream)
    if kind == "chat":
        return Request("chat" + suffix, "/v1/chat/completions",
                       {"model": "soak", "messages": messages, **common}, stream)
    return Request("completions" + suffix, "/v1/completions",
                   {"model": "soak", "prompt": prompt, **common}, stream)


# Well-formed bodies whose grammar no answer can satisfy: refused with a 400 naming the field
# (a grammar that never ends, a regex that matches nothing, a schema that requires itself).
REFUSED_GUIDED = [{"guided_grammar": 'start: "a" start'}, {"guided_regex": "a[^\\s\\S]b"},
                  {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}},
                                   "required": ["a"]}}]


def pick_bad(rng: random.Random) -> Request:
    """A body over the size limit (413), a malformed one or a grammar no answer satisfies
    (4xx), on any route."""
    route = rng.choice(["/invocations", "/v1/chat/completions", "/v1/completions"])
    draw = rng.random()
    if draw < 0.4:
        return Request("huge", route, b'{"inputs": "' + b"a" * MAX_REQUEST + b'"}')
    if draw < 0.8:
        return Request("malformed", route, rng.choice(MALFORMED))
    fields = rng.choice(REFUSED_GUIDED)
    if route == "/invocations":
        body: dict = {"inputs": "Say:", "parameters": {"max_new_tokens": 4, **fields}}
    elif route == "/v1/completions":
        body = {"prompt": "Say:", "max_tokens": 4, **fields}
    else:
        body = {"messages": [{"role": "user", "content": "Say:"}], "max_tokens": 4, **fields}
    return Request("refused-guided", route, body)


def send(url: str, req: Request) -> tuple[int, list[int], int]:
    """(status, greedy token ids when `req.reference`, 503 QueueFull retries). A 503 with
    Retry-After (queue full: overload, by design) is retried; raises requests' Timeout when
    no answer (or no stream line) comes within HANG_AFTER."""
    retries = 0
    headers = {"Content-Type": "application/json", **req.headers}
    while True:
        r = requests.post(url + req.route, data=req.data(), headers=headers, stream=req.stream,
                          timeout=(10, HANG_AFTER))
        if r.status_code != 503 or "Retry-After" not in r.headers or retries >= 1000:
            break
        r.close()
        retries += 1
        time.sleep(float(r.headers["Retry-After"]) * random.random())
    with r:
        if not req.stream or r.status_code != 200:
            text = r.content
            if r.status_code != 200 or req.reference is None:
                return r.status_code, [], retries
            return 200, [t["id"] for t in json.loads(text)["details"]["tokens"]], retries
        lines = [line for line in r.iter_lines() if line]
    if any(b'"error":' in line.replace(b" ", b"") for line in lines):
        return 599, [], retries  # an error line after the 200: the stream failed
    if req.reference is None:
        return 200, [], retries
    tokens = [json.loads(line) for line in lines]
    return 200, [t["token"]["id"] for t in tokens if "token" in t], retries


def hang_up(url: str, req: Request, rng: random.Random, mid_stream: bool) -> None:
    """Send the whole request and close the socket: before the answer (within 0.3 s: queued or
    running by then) or mid-stream (after the first bytes of the answer)."""
    address = urlparse(url)
    data = req.data()
    head = (f"POST {req.route} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in req.headers.items())
            + f"Content-Length: {len(data)}\r\n\r\n")
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(head.encode() + data)
        if mid_stream:
            try:
                sock.recv(256)  # the status line and the first stream bytes
            except OSError:
                pass
        else:
            time.sleep(rng.random() * 0.3)
