"""`batchyard bench spec` on a tiny model: every (workload, concurrency, speculation) run is
reported with its figures, and speculation generates the same tokens as decoding without it."""

from __future__ import annotations

import json

from benchmark.cli import main
from tests.models_fixtures import build_tiny_model

FIGURES = ("requests", "generated_tokens", "seconds", "output_tokens_per_s",
           "ms_per_token_mean", "ms_per_token_p50", "ttft_mean_ms")
SPEC_FIGURES = ("drafts", "draft_tokens", "acceptance_rate", "mean_acceptance_length",
                "ratio_to_no_spec")


def test_the_command_reports_every_run_with_and_without_speculation(tmp_path, capsys) -> None:
    # the repetitive prompts are ~1,100 tokens in the tiny tokenizer: more positions than 256
    model = build_tiny_model(tmp_path / "model", max_position_embeddings=2048)
    out = tmp_path / "out"
    assert main(["spec", "--model-dir", str(model), "--concurrency", "1,2",
                 "--workloads", "repetitive,lmi", "--new-tokens", "4",
                 "--lmi-new-tokens-scale", "0.05", "--device", "cpu", "--out", str(out)]) == 0
    results = json.loads((out / "spec.json").read_text())
    runs = results["runs"]
    assert [(r["workload"], r["concurrency"], r["speculation"]) for r in runs] == [
        (w, c, s) for w in ("repetitive", "lmi") for c in (1, 2) for s in (False, True)]
    for row in runs:
        assert row["requests"] == 4, row
        assert all(row[key] > 0 for key in FIGURES), row
    for off, on in zip(runs[::2], runs[1::2], strict=True):
        assert all(key in on for key in SPEC_FIGURES), on
        assert 0 <= on["acceptance_rate"] <= 1, on
        assert not on["drafts"] or on["mean_acceptance_length"] >= 1, on
        assert not any(key in off for key in SPEC_FIGURES), off
        # speculation never changes greedy output: the same tokens, so the same counts
        assert on["generated_tokens"] == off["generated_tokens"], (off, on)
        assert on["outputs_match_no_spec"] is True, on
    lmi = [r for r in runs if r["workload"] == "lmi"]
    assert all(r["generated_tokens"] == 3 + 13 + 6 + 3 for r in lmi)  # 64/256/128 x 0.05
    assert "| repetitive | 1 | ngram |" in (out / "spec.md").read_text()
    assert "| lmi | 2 | off |" in capsys.readouterr().out
