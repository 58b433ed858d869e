"""LMI model folders with their own djl_python handler (model.py), run unchanged through a real
gunicorn server: echo, dynamic batch, a wrapper around batchyard's engine, and failures."""

from __future__ import annotations

import json
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server
from tests.test_reliability_server import DISCONNECTS, send_and_hang_up, wait_for

pytestmark = pytest.mark.slow

HANDLERS = Path(__file__).resolve().parent / "fixtures" / "lmi_handlers"


def handler_dir(tmp_path: Path, name: str) -> Path:
    """A model folder holding only the handler (no weights: the handler needs none)."""
    folder = tmp_path / name
    shutil.copytree(HANDLERS / name, folder)
    return folder


def invoke(url: str, data: bytes | str, **kw) -> requests.Response:
    return requests.post(f"{url}/invocations", data=data, timeout=60, **kw)


def test_echo_handler_gets_headers_body_and_start_up_properties(tmp_path) -> None:
    folder = handler_dir(tmp_path, "echo")
    props = "option.dtype=fp32\noption.custom_key=hello\n"
    with running_server(tmp_path, folder, props) as srv:
        r = invoke(srv.url, b"\x00binary\xff", headers={"Content-Type": "image/x-test"})
        assert r.status_code == 200 and r.content == b"\x00binary\xff"
        assert r.headers["Content-Type"] == "image/x-test"
        assert r.headers["X-Echo-Length"] == "8" and r.headers["X-Request-Id"]
        init = invoke(srv.url, "x", headers={
            "X-Amzn-SageMaker-Custom-Attributes": "show=init;trace=1"}).json()
        assert init["custom_key"] == "hello" and init["dtype"] == "fp32"  # option. stripped
        assert init["model_dir"] == str(folder) and init["device_id"] == "-1"
        assert init["tensor_parallel_degree"] == "1"
        # SageMaker's runtime path reaches the same handler.
        sm = requests.post(f"{srv.url}/endpoints/any/invocations", data=b"hi", timeout=60,
                           headers={"Content-Type": "text/plain"})
        assert sm.status_code == 200 and sm.content == b"hi"
        assert "djl_python for custom handlers: batchyard's stand-in" in srv.log()


def test_batch_handler_gets_requests_grouped_and_answers_each(tmp_path) -> None:
    folder = handler_dir(tmp_path, "batch")
    with running_server(tmp_path, folder, "batch_size=4\nmax_batch_delay=500\n") as srv:
        def one(i: int) -> dict:
            r = invoke(srv.url, json.dumps({"inputs": f"request {i}"}),
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 200
            return r.json()

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(one, range(4)))
    assert [a["echo"] for a in answers] == [f"request {i}" for i in range(4)]
    assert max(a["batch_size"] for a in answers) > 1  # at least two went in one call


def test_moody_handler_errors_never_take_the_server_down(tmp_path) -> None:
    folder = handler_dir(tmp_path, "moody")
    with running_server(tmp_path, folder, "maxWorkers=2\n") as srv:
        r = invoke(srv.url, "raise")
        assert r.status_code == 424 and r.headers["Content-Type"] == "application/json"
        body = r.json()
        assert body["code"] == 424 and body["error"] == "the handler does not like this input"
        assert "Traceback" not in r.text
        assert invoke(srv.url, "oom").status_code == 507
        none = invoke(srv.url, "none")
        assert none.status_code == 204 and none.content == b""
        teapot = invoke(srv.url, "teapot")
        assert teapot.status_code == 418 and teapot.text == "short and stout"
        stream = invoke(srv.url, "stream", stream=True)
        assert stream.headers.get("Transfer-Encoding") == "chunked"
        assert stream.content == b"abc"
        broken = invoke(srv.url, "broken-stream").text.splitlines()
        assert broken[0] == "first" and json.loads(broken[1])["error"] == "stream broke"
        assert invoke(srv.url, "finalized").text == "0"
        assert invoke(srv.url, "finalized").text == "1"  # ran after the first answer
        sm = requests.post(f"{srv.url}/endpoints/any/invocations", data="raise", timeout=60)
        assert sm.status_code == 424 and sm.headers["X-Amzn-ErrorType"] == "ModelError"
        assert sm.json()["OriginalStatusCode"] == 424
        assert "does not like" in json.loads(sm.json()["OriginalMessage"])["error"]
        assert requests.get(f"{srv.url}/ping", timeout=5).status_code == 200
        assert invoke(srv.url, "still here").text == "still here"


def test_wrapper_handler_uses_the_engine_with_its_own_processing(tmp_path) -> None:
    folder = build_tiny_model(tmp_path / "wrapper")
    shutil.copy(HANDLERS / "wrapper" / "model.py", folder / "model.py")
    props = "option.rolling_batch=scheduler\noption.max_rolling_batch_size=4\nmaxWorkers=4\n"
    with running_server(tmp_path, folder, props) as srv:
        body = {"inputs": "What is the capital of France?",
                "parameters": {"max_new_tokens": 5, "ignore_eos": True, "details": True}}
        r = requests.post(f"{srv.url}/invocations", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["prompt"] == "Question: What is the capital of France?\nAnswer:"
        assert isinstance(out["answer"], str)
        lines = [json.loads(line) for line in requests.post(
            f"{srv.url}/invocations", json={**body, "stream": True}, timeout=60).iter_lines()
            if line]
        assert len(lines) == 5 and all("outputs" in line for line in lines)
        bad = requests.post(f"{srv.url}/invocations", timeout=60,
                            json={"inputs": "x", "parameters": {"top_p": 7}})
        assert bad.status_code == 424 and "top_p" in bad.json()["error"]
        assert "engine is not loaded" in srv.log()  # by the server: the handler loads it


def calls_started(folder: Path) -> list[str]:
    """The tags of the slow handler's calls that started, in order."""
    log = folder / "calls.log"
    return log.read_text().split() if log.exists() else []


def test_sigterm_drains_custom_handler_calls_and_answers_503(tmp_path) -> None:
    """Issue 56: during the drain /ping timed out and a new request hung, then got a reset
    (the drain did not wait for handler calls, so gunicorn stopped accepting at once). Now:
    both get a prompt 503; a call that ends within option.drain_timeout is answered, one still
    running then gets a 503 error; the server exits 0."""
    folder = handler_dir(tmp_path, "slow")
    with running_server(tmp_path, folder, "maxWorkers=2\noption.drain_timeout=4\n") as srv, \
            ThreadPoolExecutor(2) as pool:
        quick, stuck = (pool.submit(requests.post, f"{srv.url}/invocations", timeout=60,
                                    json={"sleep": seconds, "tag": tag})
                        for seconds, tag in ((0.5, "quick"), (60, "stuck")))
        wait_for(lambda: len(calls_started(folder)) == 2, "both calls run")
        srv.process.send_signal(signal.SIGTERM)
        wait_for(lambda: requests.get(f"{srv.url}/ping", timeout=5).status_code == 503,
                 "/ping turns 503")
        refused = requests.post(f"{srv.url}/invocations", json={"sleep": 0, "tag": "new"},
                                timeout=5)
        assert refused.status_code == 503 and refused.json()["type"] == "ServiceUnavailable"
        assert quick.result().status_code == 200 and quick.result().text == "quick"
        cut = stuck.result()
        assert cut.status_code == 503 and "shutting down" in cut.json()["message"]
        assert srv.process.wait(timeout=30) == 0
    assert "aborting 1 custom handler calls still in flight after 4 s" in srv.log()
    assert sorted(calls_started(folder)) == ["quick", "stuck"]


def test_a_queued_custom_handler_call_whose_client_left_never_starts(tmp_path) -> None:
    """Issue 56: abandoned calls still ran, and a live request waited behind them. A call
    queued behind a running one, whose client hangs up, is dropped before it starts."""
    folder = handler_dir(tmp_path, "slow")
    with running_server(tmp_path, folder, "") as srv, ThreadPoolExecutor(1) as pool:
        running = pool.submit(requests.post, f"{srv.url}/invocations", timeout=60,
                              json={"sleep": 1.5, "tag": "running"})
        wait_for(lambda: calls_started(folder) == ["running"], "the first call runs")
        send_and_hang_up(srv.url, {"sleep": 1.5, "tag": "abandoned"}).close()
        live = requests.post(f"{srv.url}/invocations", json={"sleep": 0, "tag": "live"},
                             timeout=60)
        assert live.status_code == 200 and live.text == "live"
        assert running.result().status_code == 200
        assert calls_started(folder) == ["running", "live"]
        wait_for(lambda: srv.metric(DISCONNECTS) == 1, "the abandoned call is counted")
        assert srv.metric('batchyard_requests_total{status="499"}') == 1


def test_a_custom_handler_stream_is_drained_then_cut_off_with_an_error() -> None:
    """A stream being written counts as in flight for the drain; once option.drain_timeout is
    over it stops before its next item, and the client reads a 503 line, not a silent cut."""
    from handler.lmi.bridge import row_response
    from handler.lmi.runner import HandlerRunner
    from handler.lmi.shim import ensure_djl_python

    djl = ensure_djl_python()
    runner = HandlerRunner(lambda inputs: djl.Output().add_stream_content(
        iter(["a\n", "b\n", "c\n"])), djl.Input)
    runner.start()
    row = runner.call({}, [("data", b"x")], timeout=30)
    assert row is not None
    body = row_response(row).response
    assert next(iter(body)) == b"a\n"
    runner.shutdown(grace_seconds=0.2)  # waits for the stream, then cuts it
    rest = [json.loads(line) for line in body]
    assert rest == [{"code": 503, "type": "ServiceUnavailable",
                     "message": "request aborted: the server is shutting down"}]
    runner.shutdown(grace_seconds=0)  # the stream has ended: nothing left in flight


def test_a_drain_keeps_the_answer_of_a_call_that_has_just_finished() -> None:
    """A call whose row is set but whose HTTP thread has not woken yet when the drain's time
    is up keeps its answer; only calls still waiting end with 503 (found in review: the drain
    aborted every call in flight)."""
    from handler.lmi.rows import Row
    from handler.lmi.runner import Call, HandlerRunner

    runner = HandlerRunner(lambda inputs: None, object)
    answered, waiting = Call({}, []), Call({}, [])
    answered.row = Row()
    answered.done.set()
    runner._in_flight.update({answered, waiting})  # the moment before its thread wakes
    runner.shutdown(grace_seconds=0)
    assert answered.aborted is None and answered.row is not None
    assert waiting.aborted == "shutdown" and waiting.done.is_set()
