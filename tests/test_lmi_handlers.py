"""LMI model folders with their own djl_python handler (model.py), run unchanged through a real
gunicorn server: echo, dynamic batch, a wrapper around batchyard's engine, and failures."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

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
