"""HTTP contract against a real gunicorn process on loopback, on a tiny random model."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from handler.cpu_priority import (
    SEQUENCE_STEPS_TO_DECIDE,
    STEP_BACK_BELOW_SECONDS_PER_SEQUENCE,
    usable_cpus,
)
from tests.models_fixtures import build_tiny_model
from tests.server_harness import first_answer, running_server, server_argv, wait_for_ping

pytestmark = pytest.mark.slow

CONTINUOUS = ("option.rolling_batch=scheduler\noption.max_rolling_batch_size=8\n"
              "option.max_model_len=2048\njob_queue_size=100\noption.max_request_size=4KiB\n")


def post(url: str, body, **kw) -> requests.Response:
    return requests.post(f"{url}/invocations", json=body, timeout=60, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("http-model"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("srv"), model_dir, CONTINUOUS) as srv:
        yield srv


def many_clients(url: str, n: int) -> list[requests.Response]:
    def one(i: int) -> requests.Response:
        body = {"inputs": f"Once upon a time {i}",
                "parameters": {"max_new_tokens": 4 + i % 7, "ignore_eos": True}}
        return post(url, body)
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_32_concurrent_clients_are_all_answered(server) -> None:
    """Every one of 32 concurrent requests gets its full answer; none is lost."""
    responses = many_clients(server.url, 32)
    assert [r.status_code for r in responses] == [200] * 32
    details = [post(server.url, {"inputs": "x", "parameters": {"details": True}}).json()]
    assert details[0]["details"]["finish_reason"] in ("length", "eos_token")


def test_the_worker_and_its_core_freeze_their_start_up_heap(server) -> None:
    """A full collection while serving walks every start-up object with the GIL held (~250 ms
    in an HTTP worker on 2 vCPUs): the core process and the HTTP worker freeze theirs first."""
    frozen = [line for line in server.log().splitlines() if "start-up heap frozen" in line]
    assert len(frozen) == 2
    assert sum("engine-core" in line for line in frozen) == 1


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and _stat(f"/proc/{entry.name}")["ppid"] == pid:
                kids.append(int(entry.name))
        except OSError:
            continue
    return kids


def _stat(path: str) -> dict[str, int]:
    """Two fields of /proc's stat for a process or thread (those after the command name)."""
    fields = Path(path, "stat").read_text().rsplit(")", 1)[1].split()
    return {"ppid": int(fields[1]), "nice": int(fields[16])}


def _thread_nices(pid: int) -> set[int]:
    return {_stat(str(task))["nice"] for task in Path(f"/proc/{pid}/task").iterdir()}


def _niceness_decided(log: str) -> str | None:
    """The log line that says what the HTTP threads' niceness is now (auto says it once the
    core has run enough steps to measure them)."""
    return next((x for x in log.splitlines() if "HTTP threads at niceness" in x
                 or "HTTP threads keep their CPU priority (" in x), None)


def test_http_threads_step_back_for_the_engine_core_process(server) -> None:
    """Every thread of the HTTP worker, those started for requests too, runs at the niceness
    the log states (auto: 19 with 2+ CPUs once the core's busy steps, measured while serving,
    cost under 200 µs per sequence, else none); its engine core keeps the server's."""
    # 8 such requests side by side (the batch's limit here): busy steps enough for auto
    tokens = SEQUENCE_STEPS_TO_DECIDE // 8 * 2
    body = {"inputs": "x", "parameters": {"max_new_tokens": tokens, "ignore_eos": True}}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(server.url, body), range(8)))
    assert {r.status_code for r in answers} == {200}
    end = time.monotonic() + 10
    while (line := _niceness_decided(server.log())) is None and time.monotonic() < end:
        time.sleep(0.1)
    assert line is not None, "auto never decided"
    assert len(many_clients(server.url, 8)) == 8  # request threads started after the step
    master = server.process.pid
    (worker,) = _children(master)
    (core,) = [pid for pid in _children(worker)  # not multiprocessing's resource tracker
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    step = 0 if "keep their CPU priority" in line else int(line.split("niceness +")[1].split()[0])
    base = _stat(f"/proc/{master}")["nice"]
    assert _thread_nices(worker) == {min(19, base + step)}
    assert _thread_nices(core) == {base}
    measured = re.search(r"busy steps (\d+) µs per sequence", line)
    cheap = measured is not None and int(measured[1]) < STEP_BACK_BELOW_SECONDS_PER_SEQUENCE * 1e6
    assert (step == 19) == (usable_cpus() > 1 and "=auto" in line and cheap)
    assert (measured is None) == (usable_cpus() == 1)  # one CPU: decided at once


def test_list_inputs_answer_a_list_in_order(server) -> None:
    body = {"inputs": ["The capital of France", "Once upon"],
            "parameters": {"max_new_tokens": 5, "ignore_eos": True, "details": True}}
    listed = post(server.url, body).json()
    assert isinstance(listed, list) and len(listed) == 2
    single = post(server.url, {**body, "inputs": "Once upon"}).json()
    assert listed[1]["generated_text"] == single["generated_text"]
    assert listed[0]["details"]["generated_tokens"] == 5


def test_streaming_lines_and_multibyte_text(server) -> None:
    """jsonlines: one token per line, last line has generated_text + details; text matches."""
    body = {"inputs": "Grüße aus Köln 東京", "parameters": {"max_new_tokens": 12,
                                                          "ignore_eos": True}}
    full = post(server.url, body).json()["generated_text"]
    r = post(server.url, {**body, "stream": True}, stream=True)
    assert r.headers["Content-Type"].startswith("application/jsonlines")
    lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) == 12 and all("token" in line for line in lines)
    assert lines[-1]["generated_text"] == full == "".join(x["token"]["text"] for x in lines)
    assert lines[-1]["details"]["finish_reason"] == "length"
    sse = post(server.url, body, headers={"Accept": "text/event-stream"}, stream=True)
    events = [e for e in sse.iter_lines() if e]
    assert all(e.startswith(b"data: ") for e in events) and len(events) == 12


def test_streams_are_written_by_the_output_thread_with_the_same_bytes(server) -> None:
    """HTTP/1.1 streams go out from the engine's output thread; HTTP/1.0 (not chunked) from the
    request thread, as before; the lines are the same. The stream is long: one that ends
    before its first line is written (a busy host) is rightly written by the request thread."""
    body = {"inputs": "Grüße 東京", "parameters": {"max_new_tokens": 400, "ignore_eos": True,
                                                   "details": True}, "stream": True}
    by = 'batchyard_streamed_requests_total{writer="%s"}'
    before = {w: server.metric(by % w) for w in ("output_thread", "request_thread")}
    chunked = post(server.url, body, stream=True)
    assert chunked.headers["Transfer-Encoding"] == "chunked"
    lines = chunked.content.decode()
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /invocations HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload))
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    head, _, plain = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head
    assert plain.decode() == lines and len(lines.splitlines()) == 400
    server.wait_metric(by % "output_thread", before["output_thread"] + 1)
    server.wait_metric(by % "request_thread", before["request_thread"] + 1)


def test_disconnecting_stream_aborts_and_frees_kv(server) -> None:
    """A streaming client that goes away: its request ends and its KV block is freed."""
    body = {"inputs": "long", "parameters": {"max_new_tokens": 2000, "ignore_eos": True},
            "stream": True}
    closed = 'batchyard_requests_total{status="499"}'
    before = server.metric(closed)
    r = post(server.url, body, stream=True)
    lines = r.iter_lines()
    next(lines), next(lines)
    assert server.metric("batchyard_kv_blocks_used") >= 1
    r.close()
    end = time.monotonic() + 10
    while time.monotonic() < end and server.metric(closed) == before:
        time.sleep(0.05)
    assert server.metric(closed) == before + 1, "the request ran on: it was not aborted"
    while time.monotonic() < end and server.metric("batchyard_kv_blocks_used") > 0:
        time.sleep(0.05)  # the abort reaches the engine loop on its next iteration
    assert server.metric("batchyard_kv_blocks_used") == 0
    assert server.metric("batchyard_running_sequences") == 0


@pytest.mark.parametrize(("body", "headers", "code", "words"), [
    (b"{not json", {"Content-Type": "application/json"}, 400, "malformed JSON"),
    (b"inputs=x", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "content type"),
    (json.dumps({"inputs": "x" * 5000}).encode(), {}, 413, "max_request_size=4096"),
    ({"inputs": ""}, {}, 400, "inputs"),
    ({"parameters": {}}, {}, 400, "inputs is required"),
    ({"inputs": "x", "parameters": {"max_tokens_typo": 3}}, {}, 400, "max_tokens_typo"),
    ({"inputs": "x", "parameters": {"temperature": -1}}, {}, 400, "temperature"),
    ({"inputs": "x", "parameters": {"top_p": 1.5}}, {}, 400, "top_p"),
    ({"inputs": "x", "parameters": {"max_new_tokens": "many"}}, {}, 400, "max_new_tokens"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 5000}}, {}, 400, "max_model_len"),
    ({"inputs": "x " * 1500, "parameters": {"max_new_tokens": 1000}}, {}, 400, "2048"),
    ({"inputs": "x", "parameters": {"stop": ["a"] * 17}}, {}, 400, "at most 16"),
    ({"inputs": ["x"] * 65}, {}, 400, "1 to 64"),
    ({"inputs": ["x", "y"], "stream": True}, {}, 400, "single input"),
    ({"messages": [{"role": "user"}]}, {}, 400, "messages"),
    ({"inputs": "x", "parameters": {"temperature": 1e-300}}, {}, 400, "temperature"),
    ({"inputs": "x", "parameters": {"repetition_penalty": 1000}}, {}, 400,
     "repetition_penalty"),
    (b'{"inputs": "x", "parameters": {"temperature": Infinity}}', {}, 400, "Infinity"),
    (b'{"inputs": "x", "parameters": {"top_p": 1e999}}', {}, 400, "out of range"),
    (b'{"inputs": "a\\ud800"}', {}, 400, "malformed JSON"),
    (b'{"inputs": "a\xed\xa0\x80"}', {}, 400, "malformed JSON"),  # a surrogate's raw bytes
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": 2},
     {}, 400, "top_logprobs"),
])
def test_validation_table(server, body, headers, code, words) -> None:
    """Bad requests get a JSON error naming the field and the limit; never a 500."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(f"{server.url}/invocations", data=data,
                      headers={"Content-Type": "application/json", **headers}, timeout=30)
    assert r.status_code == code, r.text
    err = r.json()
    assert err["code"] == code and words in err["message"] and "Traceback" not in r.text


def test_temperature_0_is_greedy(server) -> None:
    """OpenAI clients send temperature 0 for greedy output; it is not an error."""
    body = {"inputs": "Once upon", "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    greedy = post(server.url, body).json()["generated_text"]
    zero = post(server.url, {**body, "parameters": {**body["parameters"], "temperature": 0,
                                                    "top_k": 5}})
    assert zero.status_code == 200 and zero.json()["generated_text"] == greedy


def test_rejected_requests_are_counted_by_status(server) -> None:
    metric = 'batchyard_requests_total{status="400"}'
    before = server.metric(metric)
    assert post(server.url, {"inputs": ""}).status_code == 400
    assert post(server.url, {"inputs": "x", "parameters": {"top_k": -1}}).status_code == 400
    assert server.metric(metric) == before + 2


def test_chat_top_logprobs(server) -> None:
    """Each token comes with its k most likely alternatives; greedy picks the first."""
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    content = requests.post(f"{server.url}/v1/chat/completions", json=body,
                            timeout=30).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for token in content:
        alternatives = token["top_logprobs"]
        assert len(alternatives) == 3
        assert [a["logprob"] for a in alternatives] == sorted(
            (a["logprob"] for a in alternatives), reverse=True)
        assert alternatives[0]["logprob"] == pytest.approx(token["logprob"])
        assert bytes(token["bytes"]).decode() == token["token"]


def test_chat_completions_plain_and_streaming(server) -> None:
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 6, "ignore_eos": True}
    r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()
    assert r["object"] == "chat.completion" and r["usage"]["completion_tokens"] == 6
    same = post(server.url, body).json()
    assert same["choices"][0]["message"] == r["choices"][0]["message"]
    chunks = [json.loads(x) for x in post(server.url, {**body, "stream": True},
                                          stream=True).iter_lines() if x]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" in chunks[-1]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == r["choices"][0]["message"]["content"]


def test_metrics_add_up(server) -> None:
    """N requests of K tokens add N*K generated tokens and N TTFT samples."""
    before_tokens = server.metric("batchyard_generation_tokens_total")
    before_ttft = server.metric("batchyard_time_to_first_token_seconds_count")
    body = {"inputs": "count", "parameters": {"max_new_tokens": 7, "ignore_eos": True}}
    for _ in range(5):
        assert post(server.url, body).status_code == 200
    assert server.metric("batchyard_generation_tokens_total") - before_tokens == 35
    assert server.metric("batchyard_time_to_first_token_seconds_count") - before_ttft == 5
    assert server.metric("batchyard_kv_blocks_total") == 8


def test_dynamic_batching_answers_32_concurrent_clients(model_dir, tmp_path) -> None:
    props = "batch_size=8\nmax_batch_delay=20\noption.max_model_len=256\n"
    with running_server(tmp_path, model_dir, props) as srv:
        assert [r.status_code for r in many_clients(srv.url, 32)] == [200] * 32
        assert srv.metric("batchyard_batch_size_sum") > srv.metric("batchyard_batch_size_count")


def test_loading_queue_full_and_predict_timeout(model_dir, tmp_path) -> None:
    """/ping is 503 while loading; a full queue answers 503 + Retry-After while admitted
    requests complete; a request past predict_timeout ends with 504."""
    props = ("batch_size=1\noption.max_model_len=4096\njob_queue_size=1\n"
             "option.predict_timeout=0.5\n")
    with running_server(tmp_path, model_dir, props, env={"BATCHYARD_TEST_LOAD_DELAY": "5"},
                        wait_ready=False) as srv:
        ping = first_answer(f"{srv.url}/ping", timeout=60)
        assert ping.status_code == 503 and "loading" in ping.json()["message"]
        wait_for_ping(srv, 60)
        # A thread for each request in flight (1 running + job_queue_size 1) and 16 spare.
        assert "(1 worker, 18 threads), HTTP parser: gunicorn_h1c (C)" in srv.log()
        slow = {"inputs": "x", "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post, srv.url, slow) for _ in range(4)]
            statuses = sorted(f.result().status_code for f in futures)
        rejected = [f.result() for f in futures if f.result().status_code == 503]
        assert statuses.count(503) == 2 and rejected[0].headers["Retry-After"] == "1"
        assert set(statuses) <= {503, 504, 200}
        timed_out = post(srv.url, slow)
        assert timed_out.status_code == 504 and "predict_timeout" in timed_out.json()["message"]
        assert srv.metric("batchyard_kv_blocks_used") == 0


def test_bad_properties_value_stops_startup_with_one_line(model_dir, tmp_path) -> None:
    props = tmp_path / "bad.properties"
    props.write_text("option.rolling_batch=scheduler\noption.max_rolling_batch_size=lots\n")
    result = subprocess.run(server_argv(model_dir, props, 1), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line and "option.max_rolling_batch_size='lots'" in line
    assert "bad.properties line 2" in line and "an integer >= 1" in line


def test_sigterm_drains_in_flight_requests_and_exits_0(model_dir, tmp_path) -> None:
    props = "option.rolling_batch=scheduler\noption.max_model_len=4096\n"
    with running_server(tmp_path, model_dir, props) as srv:
        result: dict = {}
        body = {"inputs": "drain", "parameters": {"max_new_tokens": 400, "ignore_eos": True,
                                                  "details": True}}
        worker = threading.Thread(target=lambda: result.update(r=post(srv.url, body)))
        worker.start()
        time.sleep(0.3)
        srv.process.send_signal(signal.SIGTERM)
        worker.join(timeout=30)
        assert srv.process.wait(timeout=30) == 0
        assert result["r"].status_code == 200
        assert result["r"].json()["details"]["generated_tokens"] == 400


def test_paged_metrics_show_blocks_preemptions_prefix_hits_and_token_split(model_dir,
                                                                           tmp_path) -> None:
    """A pool of 40 blocks of 4 tokens for 12 requests of ~80 tokens: preemption happens,
    every answer is complete, and /metrics says so."""
    props = ("option.rolling_batch=paged\noption.max_model_len=256\noption.block_size=4\n"
             "option.num_kv_blocks=40\noption.enable_prefix_caching=true\n"
             "option.max_rolling_batch_size=16\noption.max_rolling_batch_prefill_tokens=64\n")
    with running_server(tmp_path, model_dir, props) as srv:
        def one(i: int) -> requests.Response:
            body = {"inputs": f"The capital of France is Paris. Once upon a time {i}",
                    "parameters": {"max_new_tokens": 60, "ignore_eos": True, "details": True}}
            return post(srv.url, body)
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(one, range(12)))
        assert [r.status_code for r in answers] == [200] * 12
        assert all(r.json()["details"]["generated_tokens"] == 60 for r in answers)
        assert srv.metric("batchyard_preemptions_total") > 0
        assert srv.metric("batchyard_kv_blocks_total") == 40
        assert srv.metric("batchyard_kv_blocks_used") == 0
        assert srv.metric("batchyard_prefix_cache_hit_rate") > 0
        text = requests.get(f"{srv.url}/metrics", timeout=5).text
        assert 'batchyard_step_tokens_total{kind="prefill"}' in text
        assert 'batchyard_iteration_tokens_bucket{le="64.0"}' in text
        assert srv.metric("batchyard_step_tokens_total") >= 12 * 60
