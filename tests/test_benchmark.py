"""The benchmark tools run end to end on a tiny model (figures are not checked: not timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark import loadgen
from benchmark.cli import main as bench_main
from benchmark.decode import run_decode
from benchmark.loadgen import HTTPTarget, LoadPlan, SageMakerTarget, percentiles, run_load
from benchmark.servers import ServerStartError, local_server
from benchmark.stall import run_stall
from benchmark.sweep import run_sweep
from benchmark.tables import results_table, workload_line
from benchmark.workloads import Job, lmi_jobs
from tests.models_fixtures import build_tiny_model

pytestmark = pytest.mark.slow

PAGED = "option.rolling_batch=paged\noption.max_model_len=1024\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("bench-model"), max_position_embeddings=1024)


def small_jobs() -> list[Job]:
    return [Job(job.prompt, job.new_tokens // 16) for job in lmi_jobs(9)]


def test_load_reports_every_request_and_server_steps(model_dir, tmp_path, monkeypatch,
                                                     caplog) -> None:
    props = tmp_path / "paged.properties"
    props.write_text(PAGED)
    monkeypatch.setattr(loadgen, "CLIENT_CPU_WARNING", 0.0)  # any CPU at all: it must say so
    with local_server(props, tmp_path / "server.log", model_dir) as url:
        report = run_load(HTTPTarget(url), small_jobs(), LoadPlan(3, 9),
                          metrics_url=f"{url}/metrics", progress=False)
    assert report.num_requests == 9 and report.num_errors == 0
    assert 0 < report.client_cpu_cores and "client CPU" in report.table()
    assert "the load generator used" in caplog.text
    assert report.output_tokens_per_s > 0 and report.requests_per_s > 0
    expected = sum(j.new_tokens for j in small_jobs())
    assert report.server["decode_tokens"] + 9 == expected  # first tokens come from prefills
    assert 1 <= report.server["mean_batch_size"] <= 3
    assert report.ttft["p50"] <= report.e2e["p50"] and report.inter_token["p99"] > 0
    assert len(report.samples["e2e"]) == len(report.samples["ttft"]) == 9
    assert len(report.samples["inter_token"]) == expected - 9
    assert report.mean_output_tokens == expected / 9 and report.mean_prompt_tokens > 1
    assert report.server["kv_block_size"] == 16 and report.server["kv_blocks_total"] >= 64


def test_duration_poisson_and_sagemaker_targets(model_dir, tmp_path) -> None:
    props = tmp_path / "paged.properties"
    props.write_text(PAGED)
    jobs = small_jobs()
    with local_server(props, tmp_path / "server.log", model_dir) as url:
        timed = run_load(HTTPTarget(url), jobs, LoadPlan(2, None, duration_s=1.5),
                         progress=False)
        poisson = run_load(HTTPTarget(url), jobs, LoadPlan(4, 6, request_rate=20.0, seed=1),
                           progress=False)
        runtime = SageMakerTarget("my-endpoint", "us-east-1", endpoint_url=url)
        streamed = run_load(runtime, jobs[:3], LoadPlan(3, 3), progress=False)
        whole = run_load(runtime, jobs[:3], LoadPlan(3, 3), stream=False, progress=False)
        missing = run_load(SageMakerTarget("x", "us-east-1", f"{url}/nowhere"), jobs[:1],
                           LoadPlan(1, 1), progress=False)
    assert timed.num_errors == 0 and timed.num_requests >= 1 and timed.duration_s >= 1.5
    assert poisson.num_requests == 6 and poisson.num_errors == 0
    assert streamed.num_errors == 0 and len(streamed.samples["ttft"]) == 3
    assert streamed.mean_output_tokens == sum(j.new_tokens for j in jobs[:3]) / 3
    assert whole.num_errors == 0 and whole.mean_output_tokens == streamed.mean_output_tokens
    assert missing.num_errors == 1 and missing.errors and missing.errors[0] != "0"


def test_sweep_writes_one_result_per_strategy_and_reports_a_failed_start(model_dir,
                                                                         tmp_path) -> None:
    good = tmp_path / "continuous.properties"
    good.write_text("option.rolling_batch=scheduler\noption.max_model_len=1024\n")
    bad = tmp_path / "broken.properties"
    bad.write_text("option.rolling_batch=sideways\n")
    results = run_sweep([good, bad], small_jobs(), LoadPlan(3, 9), tmp_path / "out", warmup=1,
                        overrides=["option.max_rolling_batch_size=2"], model_dir=model_dir,
                        workload="nine small jobs", requests_for={"continuous": 5})
    assert results["continuous"]["num_errors"] == 0
    assert results["continuous"]["num_requests"] == 5  # its own count, not the plan's 9
    assert "until 5 requests" in results["continuous"]["load"]
    assert results["continuous"]["server"]["mean_batch_size"] <= 2  # the override applied
    # contiguous: one max_model_len block per sequence, whatever the workload's lengths
    assert results["continuous"]["kv_workload_concurrency"] == 2
    assert results["continuous"]["workload"] == "nine small jobs"
    assert "closed loop, 3 clients, until 9 requests" in results["broken"]["load"]
    table = results_table(results)
    assert "| broken | failed: " in table and "| 2 / 2 | 5 (0) |" in table
    assert "option.rolling_batch='sideways'" in results["broken"]["error"]
    saved = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert set(saved) == {"continuous", "broken"}


def test_workload_line_names_a_strategy_that_ran_its_own_request_count() -> None:
    """The figures' subtitle: the load most strategies had, not the first one's (`none` ran
    32 of a 320-request sweep), and which ran another count; peers and failures don't count."""
    def entry(n: int, **extra) -> dict:
        return {"requests_per_s": 1.0, "num_requests": n, "workload": "LMI study",
                "load": f"closed loop, 32 clients, until {n} requests", **extra}
    results = {"none": entry(32), "dynamic": entry(320), "paged": entry(320),
               "hf-static": entry(7, kind="peer"), "broken": {"error": "failed", "load": "x"}}
    assert workload_line(results) == ("LMI study; closed loop, 32 clients, until 320 requests "
                                      "(none: 32 requests)")
    del results["none"]
    assert workload_line(results) == "LMI study; closed loop, 32 clients, until 320 requests"
    assert workload_line({"broken": {"error": "failed"}}) == ""


def test_server_that_never_answers_is_reported_not_hung_on(model_dir, tmp_path) -> None:
    props = tmp_path / "slow.properties"
    props.write_text(PAGED)
    with pytest.raises(ServerStartError, match="not ready within 3 s"):
        with local_server(props, tmp_path / "server.log", model_dir, ready_timeout=3,
                          env={"BATCHYARD_TEST_LOAD_DELAY": "60"}):
            pass


def test_stall_measures_the_running_requests(model_dir, tmp_path) -> None:
    props = tmp_path / "paged.properties"
    props.write_text(PAGED + "option.max_rolling_batch_prefill_tokens=64\n")
    with local_server(props, tmp_path / "server.log", model_dir) as url:
        report = run_stall(url, "Once upon a time " * 60, decoders=3, decode_tokens=24)
    assert report.errors == 0 and report.long_prompt_tokens > 100
    assert report.inter_token["p99"] <= report.max_inter_token_s


def test_decode_benchmark_matches_transformers_tokens(model_dir) -> None:
    report = run_decode(model_dir, new_tokens=16)
    assert report.same_tokens and report.batchyard_tokens_per_s > 0


def test_bench_load_command_exits_0(model_dir, tmp_path, capsys) -> None:
    props = tmp_path / "paged.properties"
    props.write_text(PAGED)
    with local_server(props, tmp_path / "server.log", model_dir) as url:
        code = bench_main(["load", "--url", url, "-c", "2", "-n", "3", "--warmup", "1",
                           "--json", str(tmp_path / "load.json")])
    assert code == 0 and "requests/s" in capsys.readouterr().out
    assert json.loads((tmp_path / "load.json").read_text())["num_requests"] == 3


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "mean": 50.5}
    five = percentiles([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (five["p50"], five["p90"], five["p99"]) == (3.0, 5.0, 5.0)
    assert percentiles([]) == {} and percentiles([7.0])["p99"] == 7.0


def test_bench_sweep_command_with_a_synthetic_workload_and_a_peer(model_dir, tmp_path,
                                                                  capsys) -> None:
    props = tmp_path / "paged.properties"
    props.write_text(PAGED)
    out = tmp_path / "out"
    code = bench_main(["sweep", str(props), "-c", "2", "-n", "4", "--warmup", "1",
                       "--model-dir", str(model_dir), "--out", str(out), "--workload",
                       "synthetic", "--prompt-tokens", "uniform:4:12", "--output-tokens", "5",
                       "--kv-cache-memory", "4MiB", "--peers", "hf-static,batchyard",
                       "--engine-properties", str(props), "--set", "option.block_size=8"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    strategy = json.loads((out / "sweep.json").read_text())["paged"]
    assert strategy["workload"].startswith("synthetic: prompts of uniform:4:12 tokens, exactly 5")
    assert "option.kv_cache_memory=4MiB" in strategy["overrides"]
    assert strategy["mean_output_tokens"] == 5 and 4 <= strategy["mean_prompt_tokens"] <= 12
    peer = json.loads((out / "peers.json").read_text())["hf-static"]
    assert peer["num_requests"] == 4 and peer["num_errors"] == 0
    assert peer["mean_output_tokens"] == 5 and "hf-static" in printed
    ours = json.loads((out / "peers.json").read_text())["batchyard"]
    assert ours["num_errors"] == 0 and ours["mean_output_tokens"] == 5, ours.get("error")
    assert "block_size=8" in (out / "batchyard-peer.properties").read_text()
    assert "kv_cache_memory=4MiB" in (out / "paged.properties").read_text()  # the sweep's own


def test_a_strategy_that_fails_mid_run_is_reported_and_the_sweep_goes_on(tmp_path,
                                                                         monkeypatch) -> None:
    import contextlib

    from benchmark import sweep

    @contextlib.contextmanager
    def fake_server(properties, log_path, model_dir=None):
        yield "http://127.0.0.1:9"

    calls = []

    def load(target, jobs, plan, stream=True, metrics_url=None, progress=True):
        calls.append(metrics_url)
        if len(calls) == 1:
            raise ConnectionError("server went away")
        return sweep.LoadReport(plan.concurrency, 1, 0, 1.0, 1.0, 1.0, {}, {}, {}, {}, [])

    monkeypatch.setattr(sweep, "local_server", fake_server)
    monkeypatch.setattr(sweep, "run_load", load)
    files = [tmp_path / "first.properties", tmp_path / "second.properties"]
    for f in files:
        f.write_text("option.rolling_batch=paged\n")
    results = run_sweep(files, small_jobs(), LoadPlan(1, 1), tmp_path / "out", warmup=0)
    assert results["first"]["error"].startswith("ConnectionError: server went away; log ")
    assert results["second"]["requests_per_s"] == 1.0
    assert set(json.loads((tmp_path / "out" / "sweep.json").read_text())) == {"first", "second"}


def test_http_load_needs_no_aws_sdk() -> None:
    """The HTTP load client runs where boto3 is not installed (a bare GPU machine, say)."""
    stream = (b'{"token": {"text": "a"}}\n{"generated_text": "a", '
              b'"details": {"finish_reason": "length", "inputs": 2}}\n')
    code = ("import sys\nsys.modules['boto3'] = sys.modules['botocore'] = None\n"
            "from benchmark.loadgen import run_load\nfrom benchmark.targets import stream_result\n"
            f"r = stream_result(0.0, [{stream!r}])\n"
            "assert r.ok and r.num_output_tokens == 1 and r.num_prompt_tokens == 2, r\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_bench_soak_reports_its_targets_and_leaves_nothing_running(tmp_path, capsys) -> None:
    """A few dozen requests of every kind (hang-ups and bad bodies at high shares so each
    appears): exit 0, every report field, nothing running or waiting, every KV block free."""
    import psutil

    code = bench_main(["soak", "--requests", "40", "--clients", "6", "--hang-ups", "0.2",
                       "--bad", "0.2", "--idle", "0.5", "--json", str(tmp_path / "soak.json")])
    report = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0, report["failed"]
    assert json.loads(capsys.readouterr().out) == report
    assert report["failed"] == [] and report["5xx"] == 0 and report["hangs"] == 0
    assert report["leaked_kv_blocks"] == 0 and report["after_idle"]["kv_blocks_total"] == 48
    assert report["after_idle"]["running_sequences"] == report["after_idle"]["queue_depth"] == 0
    assert report["ping"]["count"] > 0 and report["ping"]["p99_ms"] < 1000
    assert sum(report["totals_by_status"].values()) == 40
    assert set(report["statuses_by_route"]) == {"/invocations", "/v1/chat/completions",
                                                "/v1/completions"}
    assert report["totals_by_status"]["200"] > 0 and report["5xx_by_route"] == {}
    assert {"huge", "malformed", "refused-guided"} & set(report["kinds"])
    def serves(p: psutil.Process) -> bool:
        try:
            return "handler.cli" in " ".join(p.cmdline())
        except psutil.Error:  # gone meanwhile
            return False

    assert not [p for p in psutil.Process().children(recursive=True) if serves(p)]
