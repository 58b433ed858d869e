"""`batchyard bench peers` runs transformers' engines on a tiny model in worker processes and
reports a peer that cannot run instead of raising (figures are not checked: not timed)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmark.peers import install_vllm, run_peers
from benchmark.workloads import Job, lmi_jobs
from tests.models_fixtures import build_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("peer-model"), max_position_embeddings=1024)


def small_jobs() -> list[Job]:
    return [Job(job.prompt, job.new_tokens // 4) for job in lmi_jobs(6)]  # 16, 64, 32 tokens


def generate_alone(model_dir, job: Job) -> list[int]:
    """Plain greedy `generate` of one request, EOS never stopping it."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([AutoTokenizer.from_pretrained(model_dir).encode(job.prompt)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=job.new_tokens, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_transformers_peers_finish_every_request_with_generate_s_tokens(model_dir,
                                                                        tmp_path) -> None:
    jobs = small_jobs()
    results = run_peers(["hf-static", "hf-cb"], jobs, 3, model_dir, tmp_path)
    expected = generate_alone(model_dir, jobs[0])[:16]
    for name, r in results.items():
        assert "error" not in r, r.get("error")
        assert r["kind"] == "peer" and r["num_requests"] == 6 and r["num_errors"] == 0, name
        assert r["mean_output_tokens"] * 6 == sum(j.new_tokens for j in jobs), name
        assert r["first_tokens"] == expected, name
        assert len(r["samples"]["ttft"]) == 6 and r["ttft"]["p50"] <= r["e2e"]["p50"], name
        assert r["threads"] >= 1 and r["versions"]["transformers"] and "batch" in r["note"]
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = sum(len(tokenizer.encode(j.prompt)) for j in jobs) / 6
        assert r["mean_prompt_tokens"] == pytest.approx(prompts), name
    assert set(json.loads((tmp_path / "peers.json").read_text())) == {"hf-static", "hf-cb"}
    assert (tmp_path / "hf-cb.json").is_file() and (tmp_path / "hf-cb.log").is_file()


def test_batchyard_engine_runs_offline_as_a_peer(model_dir, tmp_path) -> None:
    """Our own engine through the peer protocol: same tokens as generate, the budget applied."""
    props = tmp_path / "paged.properties"
    props.write_text("option.rolling_batch=paged\noption.max_rolling_batch_size=4\n"
                     "option.max_model_len=256\n")
    jobs = small_jobs()
    r = run_peers(["batchyard"], jobs, 3, model_dir, tmp_path / "out",
                  kv_cache_bytes=2 * 2**20, engine_properties=props)["batchyard"]
    assert "error" not in r, r.get("error")
    assert r["num_errors"] == 0 and r["num_requests"] == 6
    assert r["mean_output_tokens"] * 6 == sum(j.new_tokens for j in jobs)
    assert r["first_tokens"] == generate_alone(model_dir, jobs[0])[:16]
    assert r["note"].startswith("batchyard's paged engine offline")
    assert "KV cache 2 MiB" in r["note"]
    assert len(r["samples"]["ttft"]) == 6 and r["ttft"]["p50"] <= r["e2e"]["p50"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transformers_peers_on_gpu(model_dir, tmp_path) -> None:
    jobs = small_jobs()
    results = run_peers(["hf-static", "hf-cb"], jobs, 3, model_dir, tmp_path, device="cuda")
    for name, r in results.items():
        assert "error" not in r, r.get("error")
        assert r["num_errors"] == 0 and r["note"].endswith("on cuda"), name
        assert r["mean_output_tokens"] * 6 == sum(j.new_tokens for j in jobs), name


def test_missing_vllm_interpreter_is_reported_with_how_to_install(model_dir, tmp_path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    results = run_peers(["vllm", "vllm-all"], small_jobs(), 3, model_dir, tmp_path / "out",
                        vllm_python=missing)
    for r in results.values():
        assert r["kind"] == "peer" and str(missing) in r["error"]
        assert "install_vllm" in r["error"] and "--install-vllm" in r["error"]


def test_peer_that_crashes_or_hangs_is_reported_with_its_log(model_dir, tmp_path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").unlink()  # the tokenizer loads, the model does not
    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nsleep 60\n")
    hang.chmod(0o755)
    out = tmp_path / "out"
    crashed = run_peers(["hf-static"], small_jobs(), 3, broken, out)["hf-static"]
    assert "exited with code 1" in crashed["error"]
    assert str(out / "hf-static.log") in crashed["error"]
    hung = run_peers(["vllm"], small_jobs(), 3, model_dir, out, vllm_python=hang,
                     timeout_s=1)["vllm"]
    assert "timed out after 1 s" in hung["error"] and str(out / "vllm.log") in hung["error"]
    assert json.loads((out / "peers.json").read_text()) == {"vllm": hung}


def test_vllm_install_failure_names_the_step(tmp_path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(RuntimeError, match="failed at 'create the virtualenv'"):
        install_vllm(tmp_path / "file" / "venv")


def test_peers_command_runs_the_default_set_and_reports_a_failed_vllm_install(
        model_dir, tmp_path, monkeypatch, capsys) -> None:
    from benchmark import peers
    from benchmark.cli import main as bench_main

    def failing_install(venv):
        raise RuntimeError(f"installing vLLM into {venv} failed at 'pip install' (exit code 1)")

    monkeypatch.setattr(peers, "install_vllm", failing_install)
    code = bench_main(["peers", "-c", "2", "-n", "2", "--model-dir", str(model_dir), "--out",
                       str(tmp_path), "--install-vllm", "--vllm-venv", str(tmp_path / "venv"),
                       "--workload", "synthetic", "--prompt-tokens", "5", "--output-tokens", "3"])
    assert code == 1  # vllm-all could not run
    results = json.loads((tmp_path / "peers.json").read_text())
    assert list(results) == ["hf-static", "hf-cb", "vllm-all"]  # the default set
    assert results["hf-static"]["num_errors"] == 0 and results["hf-cb"]["num_errors"] == 0
    assert "failed at 'pip install'" in results["vllm-all"]["error"]
    assert "vllm-all" in capsys.readouterr().out
    assert bench_main(["peers", "sglang"]) == 2  # unknown names: a one-line error
    assert bench_main(["sweep", "--peers", "hf-static", "--duration", "5"]) == 2  # before running
