"""`bench goodput`: the SLO rules (TPOT, attainment, goodput, the rate search) on made-up
results, the report files, and one short end-to-end run against a tiny model's server."""

from __future__ import annotations

import json
import time

import pytest

from benchmark.cli import main
from benchmark.goodput import default_files, parse_rates
from benchmark.goodput_report import GOODPUT_PNG, goodput_table, load_goodput, runs_table
from benchmark.slo import (
    SLO,
    goodput,
    goodput_text,
    highest_passing,
    meets,
    rate_summary,
    search_rates,
    tpot,
    ttft,
)
from benchmark.targets import RequestResult
from tests.models_fixtures import build_tiny_model

SLO_1S = SLO(ttft_s=1.0, tpot_s=0.1)


def result(first: float, gap: float, tokens: int, ok: bool = True) -> RequestResult:
    """A streamed request due at t=10: first token after `first` s, then one every `gap` s."""
    times = [10 + first + i * gap for i in range(tokens)]
    end = times[-1] if times else 10 + first
    return RequestResult(ok=ok, start=10.0, end=end, token_times=times,
                         num_output_tokens=tokens)


def test_tpot_is_the_mean_time_per_token_after_the_first() -> None:
    r = result(first=0.5, gap=0.2, tokens=6)
    assert ttft(r) == pytest.approx(0.5)
    assert tpot(r) == pytest.approx(0.2)  # (e2e 1.5 - ttft 0.5) / 5
    uneven = RequestResult(ok=True, start=0.0, end=2.0, token_times=[0.5, 0.6, 2.0],
                           num_output_tokens=3)
    assert tpot(uneven) == pytest.approx(0.75)  # a mean, not the largest gap
    assert tpot(result(first=0.5, gap=0.2, tokens=1)) is None
    assert ttft(RequestResult(ok=False, start=0.0, end=1.0)) is None


def test_a_request_meets_both_slos_or_says_which_it_missed() -> None:
    assert meets(result(0.5, 0.05, 10), SLO_1S) == (True, True)
    assert meets(result(1.5, 0.05, 10), SLO_1S) == (False, True)
    assert meets(result(0.5, 0.5, 10), SLO_1S) == (True, False)
    assert meets(result(0.5, 0.0, 1), SLO_1S) == (True, True)  # one token: TPOT trivially met
    assert meets(result(0.1, 0.01, 5, ok=False), SLO_1S) == (False, False)  # failed: neither


def test_rate_summary_counts_every_request_and_the_request_goodput() -> None:
    results = [result(0.5, 0.05, 10)] * 6 + [result(2.0, 0.05, 10), result(0.5, 0.3, 4),
                                              result(0.2, 0.01, 3, ok=False)]
    run = rate_summary(2.0, results, duration_s=4.0, slo=SLO_1S)
    assert run["requests"] == 9 and run["errors"] == 1
    assert run["attainment"] == pytest.approx(6 / 9, abs=1e-4)
    assert run["ttft_met"] == pytest.approx(7 / 9, abs=1e-4)
    assert run["tpot_met"] == pytest.approx(7 / 9, abs=1e-4)
    assert run["request_goodput"] == 1.5 and run["requests_per_s"] == 2.0
    assert run["ttft_p50_ms"] == 500.0 and run["ttft_p90_ms"] == 2000.0
    assert run["tpot_p50_ms"] == 50.0 and run["tpot_p90_ms"] == 300.0
    empty = rate_summary(1.0, [], duration_s=1.0, slo=SLO_1S)
    assert empty["attainment"] == 0.0 and empty["ttft_p50_ms"] is None


def test_goodput_is_the_first_crossing_of_the_target() -> None:
    points = [(4.0, 0.5), (1.0, 1.0), (2.0, 0.92)]
    assert goodput(points, 0.9) == 2.0 and goodput_text(2.0, points) == "2 req/s"
    # nothing meets it: below the lowest rate
    assert goodput([(1.0, 0.8), (2.0, 0.4)], 0.9) is None
    assert goodput_text(None, [(1.0, 0.8), (2.0, 0.4)]) == "below the lowest rate (1 req/s)"
    # non-monotonic: a pass above a miss is not goodput, but is reported as the highest pass
    wobbly = [(0.5, 1.0), (1.0, 0.85), (2.0, 0.95), (4.0, 0.2)]
    assert goodput(wobbly, 0.9) == 0.5 and highest_passing(wobbly, 0.9) == 2.0
    # every rate held: at least the highest
    assert goodput_text(goodput([(1.0, 1.0)], 0.9), [(1.0, 1.0)]).startswith(">= 1 req/s")
    assert goodput_text(None, []) == "not measured"
    with pytest.raises(ValueError):
        SLO(ttft_s=0.0, tpot_s=0.1)


def test_the_search_doubles_then_bisects_to_the_crossing() -> None:
    def capacity(limit: float):
        return lambda rate: 1.0 if rate <= limit else 0.5

    points = search_rates(capacity(3.0), 0.9, start=0.5, bisect_steps=2)
    assert [r for r, _ in points] == [0.5, 1.0, 2.0, 4.0, 3.0, 3.5]
    assert goodput(points, 0.9) == 3.0
    # the first rate misses: bisect below it, between 0 and the start
    low = search_rates(capacity(0.3), 0.9, start=1.0, bisect_steps=2)
    assert [r for r, _ in low] == [1.0, 0.5, 0.25] and goodput(low, 0.9) == 0.25
    # never misses: stops at the cap without bisecting
    assert [r for r, _ in search_rates(capacity(99), 0.9, start=1.0, max_rate=4.0)] == [
        1.0, 2.0, 4.0]


def test_options_parse_and_default_files_include_disaggregated_when_present(tmp_path) -> None:
    assert parse_rates("2, 0.5,1") == [0.5, 1.0, 2.0]
    for bad in ("", "0,1", "fast"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    assert [p.stem for p in default_files(tmp_path)] == ["none", "dynamic", "continuous",
                                                         "paged"]
    (tmp_path / "disaggregated.properties").write_text("option.rolling_batch=paged\n")
    assert default_files(tmp_path)[-1].stem == "disaggregated"


def saved_results() -> dict:
    run = rate_summary(1.0, [result(0.5, 0.05, 10)] * 4, 4.0, SLO_1S)
    miss = rate_summary(2.0, [result(2.0, 0.05, 10)] * 4, 2.0, SLO_1S)
    return {"slo": {"ttft_ms": 1000.0, "tpot_ms": 100.0, "attainment": 0.9},
            "workload": "w", "load": "l", "rates": "rates 1,2",
            "configurations": {
                "paged": {"runs": [miss, run], "goodput_rps": 1.0, "highest_passing_rps": 1.0,
                          "goodput": "1 req/s"},
                "broken": {"runs": [], "error": "server exited | code 1\ntrace",
                           "goodput_rps": None, "highest_passing_rps": None,
                           "goodput": "not measured"}}}


def test_tables_show_each_rate_and_each_goodput() -> None:
    results = saved_results()
    rows = runs_table(results).splitlines()
    assert rows[2] == ("| paged | 1 | 4 (0) | 100% | 100% | 100% | 500 / 500 | 50 / 50 | "
                       "1.000 |")
    assert rows[3].startswith("| paged | 2 | 4 (0) | 0% | 0% | 100% | 2000 / 2000 |")
    assert rows[4].startswith("| broken | failed: server exited \\| code 1 |")
    table = goodput_table(results)
    assert "| paged | 1 req/s |  |" in table and "| broken | not measured | failed:" in table


@pytest.mark.slow
def test_the_command_measures_two_rates_and_writes_json_markdown_and_plot(tmp_path,
                                                                          capsys) -> None:
    """A short real run: two rates of 3 requests on a tiny model's paged server."""
    started = time.monotonic()
    model = build_tiny_model(tmp_path / "model", max_position_embeddings=512)
    props = tmp_path / "paged.properties"
    props.write_text("option.rolling_batch=paged\noption.max_model_len=512\n")
    out = tmp_path / "out"
    code = main(["goodput", "--properties", str(props), "--model-dir", str(model),
                 "--rates", "2,8", "--requests", "3", "--warmup", "1", "--workload", "lmi",
                 "--ttft-slo", "5000", "--tpot-slo", "1000", "--set", "option.block_size=16",
                 "--out", str(out)])
    assert code == 0
    results = load_goodput(out)
    assert results is not None and results == json.loads((out / "goodput.json").read_text())
    paged = results["configurations"]["paged"]
    assert [r["rate"] for r in paged["runs"]] == [2.0, 8.0]
    for run in paged["runs"]:
        assert run["requests"] == 3 and run["errors"] == 0
        assert run["attainment"] == 1.0 and run["ttft_p50_ms"] > 0 and run["tpot_p50_ms"] > 0
    assert paged["goodput"].startswith(">= 8 req/s")
    assert "option.block_size=16" in (out / "paged.goodput.properties").read_text()
    assert "| paged | 8 | 3 (0) | 100% |" in (out / "goodput.md").read_text()
    assert (out / GOODPUT_PNG).read_bytes()[:4] == b"\x89PNG"
    assert "| paged | >= 8 req/s" in capsys.readouterr().out
    assert time.monotonic() - started < 40


def test_bench_plot_draws_a_goodput_folder_and_adds_the_sweep_column(tmp_path, capsys) -> None:
    from benchmark.report import plot_main
    from tests.test_notebook import load_result

    folder = tmp_path / "sweep"
    (folder / "goodput").mkdir(parents=True)
    (folder / "goodput" / "goodput.json").write_text(json.dumps(saved_results()))
    assert plot_main(folder / "goodput") == 0  # a goodput folder alone
    assert (folder / "goodput" / GOODPUT_PNG).read_bytes()[:4] == b"\x89PNG"
    assert "| paged | 1 req/s |" in capsys.readouterr().out
    (folder / "sweep.json").write_text(json.dumps({"paged": load_result(2.0),
                                                   "dynamic": load_result(1.0)}))
    assert plot_main(folder) == 0  # the sweep's folder: goodput/ is found, a column added
    printed = capsys.readouterr().out
    assert "| requests (errors) | goodput under SLOs |" in printed
    assert "| 6 (0) | 1 req/s |" in printed and "| 6 (0) | – |" in printed  # dynamic: none
    assert "| broken | (not in this sweep) |" in printed
    assert "- **goodput under SLOs**: `bench goodput`: SLOs TTFT <= 1000 ms" in printed
