"""`batchyard bench peers` runs transformers' engines on a tiny model in worker processes and
reports a peer that cannot run instead of raising (figures are not checked: not timed)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmark import peers as peers_module
from benchmark.peer_hf import HF_PAGE_SIZE, hf_cb_settings
from benchmark.peers import install_vllm, kv_mismatch, run_peers
from benchmark.tables import VLLM_PUBLISHED, results_table
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


def test_hf_cb_gets_the_kv_budget_as_whole_blocks_of_its_own_size(model_dir) -> None:
    """transformers' num_blocks counts blocks of page_size tokens of K and V in every layer: the
    tiny model's 2 layers x 2 KV heads x 16 dims x 2 (K, V) = 128 values a token."""
    config = AutoConfig.from_pretrained(model_dir)
    requests = [{"prompt_ids": [1] * 20, "new_tokens": 300}]
    block = 128 * HF_PAGE_SIZE  # values in one block
    fp32 = hf_cb_settings(config, torch.float32, requests, 3, 2**20)
    assert fp32 == {"page_size": HF_PAGE_SIZE, "num_blocks": 2**20 // (4 * block),
                    "max_requests_per_batch": 3, "allow_block_sharing": False}
    assert hf_cb_settings(config, torch.bfloat16, requests, 3, 2**20)["num_blocks"] == 16
    # rounded up: the peer never holds fewer tokens than batchyard's pool of those bytes
    assert hf_cb_settings(config, torch.float32, requests, 3, 2**20 + 1)["num_blocks"] == 9
    # no budget: the 3 longest requests (320 tokens: 2 pages, +1) and 10 % more, as before
    assert hf_cb_settings(config, torch.float32, requests, 3, None)["num_blocks"] == 10


def test_the_kv_budget_and_device_reach_each_worker(model_dir, tmp_path, monkeypatch) -> None:
    seen: dict[str, list[str]] = {}

    class Exits:  # each worker "exits" at once: only its command line matters here
        def __init__(self, argv: list[str], **_) -> None:
            seen[argv[argv.index("--peer") + 1]] = argv

        def wait(self, timeout: float | None = None) -> int:
            return 1

    monkeypatch.setattr(peers_module.subprocess, "Popen", Exits)
    run_peers(["hf-static", "hf-cb", "batchyard"], small_jobs(), 3, model_dir, tmp_path,
              dtype="bfloat16", kv_cache_bytes=2**20, device="cuda")

    def option(name: str, flag: str) -> str | None:
        argv = seen[name]
        return argv[argv.index(flag) + 1] if flag in argv else None

    assert option("hf-cb", "--kv-cache-bytes") == option("batchyard", "--kv-cache-bytes") \
        == str(2**20)
    assert option("hf-static", "--kv-cache-bytes") is None  # generate's cache is not paged
    for name in seen:
        assert option(name, "--device") == "cuda" and option(name, "--dtype") == "bfloat16"


def test_hf_cb_and_batchyard_build_pools_of_the_same_tokens_from_one_budget(model_dir,
                                                                           tmp_path) -> None:
    props = tmp_path / "paged.properties"  # its cap, 4 x 512 tokens, is the budget's 2,048
    props.write_text("option.rolling_batch=paged\noption.max_rolling_batch_size=4\n"
                     "option.max_model_len=512\n")
    out = tmp_path / "out"
    results = run_peers(["hf-cb", "batchyard"], small_jobs(), 3, model_dir, out,
                        kv_cache_bytes=2**20, engine_properties=props)
    for name, r in results.items():
        assert "error" not in r and r["num_errors"] == 0, r.get("error")
        assert r["kv_cache_bytes"] == 2**20 and r["kv_tokens"] == 2048, name
        assert r["device"] == "cpu" and "KV cache 1 MiB (2048 tokens)" in r["note"], name
        assert r["kv_workload_concurrency"] >= 3, name
    assert results["hf-cb"]["kv_block_size"] == HF_PAGE_SIZE
    assert results["batchyard"]["kv_block_size"] == 16
    assert kv_mismatch(results) == ""
    saved = json.loads((out / "peers.json").read_text())
    assert saved["hf-cb"]["kv_tokens"] == saved["batchyard"]["kv_tokens"] == 2048
    assert VLLM_PUBLISHED["name"] not in results_table(saved)  # measured on the CPU


def test_kv_pools_that_differ_are_named() -> None:
    ours = {"kv_tokens": 1024, "kv_block_size": 16, "kv_cache_bytes": 2**20}
    theirs = {"kv_tokens": 2048, "kv_block_size": HF_PAGE_SIZE, "kv_cache_bytes": 2**20}
    assert "batchyard 1024 tokens, hf-cb 2048 tokens" in kv_mismatch(
        {"batchyard": ours, "hf-cb": theirs})
    assert kv_mismatch({"batchyard": ours, "hf-cb": {**theirs, "kv_tokens": 1200}}) == ""
    assert kv_mismatch({"batchyard": ours}) == ""
    assert kv_mismatch({"batchyard": {**ours, "kv_cache_bytes": None}, "hf-cb": theirs}) == ""


def test_a_gpu_table_shows_vllms_published_figure_marked_not_measured() -> None:
    def peer(device: str) -> dict:
        return {"kind": "peer", "requests_per_s": 2.0, "num_requests": 4, "num_errors": 0,
                "device": device, "kv_cache_bytes": 2**29, "kv_tokens": 16384,
                "kv_workload_concurrency": 55, "note": "a peer"}

    gpu = results_table({"batchyard": peer("cuda"), "hf-cb": peer("cuda")})
    row = next(line for line in gpu.splitlines() if line.startswith("| vllm (published) |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1].startswith("published, not measured here: decode step")
    assert "2.1× its floor" in cells[1] and "Llama-3.1-8B, batch 8, H200" in cells[1]
    assert not any(cells[2:])  # no figure of vLLM's in our columns: it is not a rate
    assert f"source: {VLLM_PUBLISHED['source']}" in gpu and "https://perf.vllm.ai" in gpu
    assert gpu.count("| 55 / – |") == 2  # the budget, as the sequences each pool holds
    assert "vllm (published)" not in results_table({"batchyard": peer("cpu")})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hf_cb_and_batchyard_on_gpu_share_one_budget(model_dir, tmp_path) -> None:
    props = tmp_path / "paged.properties"  # bf16: 1 MiB is 4,096 tokens, its cap 8 x 512
    props.write_text("option.rolling_batch=paged\noption.max_rolling_batch_size=8\n"
                     "option.max_model_len=512\n")
    results = run_peers(["hf-cb", "batchyard"], small_jobs(), 3, model_dir, tmp_path,
                        dtype="bfloat16", kv_cache_bytes=2**20, device="cuda",
                        engine_properties=props)
    for name, r in results.items():
        assert "error" not in r and r["num_errors"] == 0, r.get("error")
        assert r["device"] == "cuda" and r["kv_tokens"] == 4096, name
    assert "vllm (published)" in results_table(results)
