"""option.api_server_count=2 through the real server: two gunicorn workers share one engine core
process; answers equal one worker's, /metrics from either counts both, SIGTERM stops all."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import requests
from gunicorn.errors import HaltServer

from engine import CoreAddress, EngineConfig
from handler.config.serving_config import ServingConfig
from handler.http import server
from handler.http.state import ServerState
from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

pytestmark = pytest.mark.slow

HANDLERS = Path(__file__).resolve().parent / "fixtures" / "lmi_handlers"
PAGED = ("option.rolling_batch=paged\noption.max_rolling_batch_size=8\n"
         "option.max_model_len=256\njob_queue_size=16\n")
PROMPTS = [f"prompt number {i} " * (1 + i % 3) for i in range(12)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("api-servers-model"))


def texts(url: str) -> list[str]:
    def one(prompt: str) -> str:
        r = requests.post(f"{url}/invocations", timeout=60, json={
            "inputs": prompt, "parameters": {"max_new_tokens": 12, "do_sample": False}})
        assert r.status_code == 200, r.text
        return r.json()["generated_text"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, PROMPTS))


def answering_workers(log: str) -> set[str]:
    """The request-id prefixes in the request log: one per worker."""
    return {line.split("request req-")[1].split("-")[0]
            for line in log.splitlines() if "request req-" in line}


def children(pid: int) -> list[int]:
    """The processes `pid` forked that still run its command line."""
    command = Path(f"/proc/{pid}/cmdline").read_bytes()
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and Path(f"/proc/{name}/cmdline").read_bytes() == command:
                found.append(int(name))
        except OSError:
            continue
    return found


def core_pid_and_dir(log: str) -> tuple[int, Path]:
    line = log.split("engine core process ")[1].splitlines()[0]
    return int(line.split()[0]), Path(line.split(" connect to it in ")[1])


def test_two_http_processes_share_one_core(model_dir, tmp_path) -> None:
    with running_server(tmp_path, model_dir, PAGED) as one:
        expected = texts(one.url)
    with running_server(tmp_path, model_dir, PAGED + "option.api_server_count=2\n"
                        "option.api_server_nice=3\n") as two:
        rounds = 1
        assert texts(two.url) == expected
        while len(answering_workers(two.log())) < 2:  # the kernel picks the worker
            assert texts(two.url) == expected
            rounds += 1
            assert rounds < 20, "one worker answered every request"
        log = two.log()
        assert "(2 workers," in log and "a serving process connected (2 now)" in log
        assert log.count("connected to the engine core") == 2
        assert log.count("engine ready:") == 1  # the model was loaded once
        # both HTTP processes step back for the shared core, which keeps the server's priority
        base = os.getpriority(os.PRIO_PROCESS, two.process.pid)
        workers = children(two.process.pid)  # forks of the master: its command line
        assert len(workers) == 2 and log.count("HTTP threads at niceness +3") == 2
        assert {os.getpriority(os.PRIO_PROCESS, int(tid)) for w in workers
                for tid in os.listdir(f"/proc/{w}/task")} == {min(19, base + 3)}
        assert os.getpriority(os.PRIO_PROCESS, core_pid_and_dir(log)[0]) == base
        # Either worker answers the scrape, and it counts the requests both answered, and
        # each engine step once (its facts reach one worker only).
        requests_made = rounds * len(PROMPTS)
        for _ in range(4):
            assert two.metric('batchyard_requests_total{status="200"}') == requests_made
            assert two.metric("batchyard_generation_tokens_total") == 12 * requests_made
            assert two.metric('batchyard_step_tokens_total{kind="decode"}') == 11 * requests_made
            assert two.metric('batchyard_step_tokens_total{kind="prefill"}') == two.metric(
                "batchyard_prompt_tokens_total")
            assert two.metric("batchyard_running_sequences") == 0
        stream = requests.post(f"{two.url}/invocations", stream=True, timeout=60, json={
            "inputs": "x", "parameters": {"max_new_tokens": 3}, "stream": True})
        assert stream.status_code == 200 and len(list(stream.iter_lines())) == 3
        two.process.send_signal(signal.SIGTERM)
        assert two.process.wait(timeout=60) == 0
        assert "a serving process left (0 now)" in two.log()
        pid, private = core_pid_and_dir(log)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert not private.exists()  # socket, start markers, the workers' metrics files


def test_a_killed_server_takes_its_core_and_files_along(model_dir, tmp_path) -> None:
    """SIGKILL runs no exit hook: the core notices its parent is gone and cleans up."""
    with running_server(tmp_path, model_dir, PAGED + "option.api_server_count=2\n") as srv:
        pid, private = core_pid_and_dir(srv.log())
        assert (private / "metrics").is_dir()
        srv.process.kill()
        srv.process.wait(10)
        end = time.monotonic() + 30
        while (process_exists(pid) or private.exists()) and time.monotonic() < end:
            time.sleep(0.1)
        assert not process_exists(pid) and not private.exists()


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_model_py_handler_is_refused_rather_than_run_once_per_process(model_dir,
                                                                         tmp_path) -> None:
    folder = tmp_path / "with-handler"
    shutil.copytree(model_dir, folder)
    shutil.copy(HANDLERS / "echo" / "model.py", folder / "model.py")
    with running_server(tmp_path, folder, PAGED + "option.api_server_count=2\n",
                        wait_ready=False) as srv:
        assert srv.process.wait(timeout=120) == 3
        assert "serve it with option.api_server_count=1" in srv.log()


def test_a_worker_failing_to_boot_while_gunicorn_halts_still_exits_3(monkeypatch) -> None:
    """gunicorn's halt() reaps the other workers and raises HaltServer again, out of run(),
    when one of them failed to boot too (two workers refusing a model.py, under load): the
    master exits with that status, not 1 with a trace."""
    def halting_twice(self) -> None:
        raise HaltServer("Worker failed to boot.", 3)

    monkeypatch.setattr(server.GunicornServer, "run", halting_twice)
    with pytest.raises(SystemExit) as exit_:
        server.run_server(lambda: None, "127.0.0.1", 0, workers=2)
    assert exit_.value.code == 3


def test_no_worker_says_ready_before_all_have_started(tmp_path) -> None:
    """Until every worker has connected once, the kernel may hand a request to one still
    loading: /ping stays 503 on those that are ready."""
    config = ServingConfig(engine=EngineConfig(model=str(tmp_path)), api_server_count=2)
    state = ServerState(config, core_address=CoreAddress(str(tmp_path / "core.sock"), b"k"))
    (tmp_path / "started-101").touch()
    assert not state._all_workers_started()
    (tmp_path / "started-102").touch()
    assert state._all_workers_started()
