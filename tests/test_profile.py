"""Step anatomy (`batchyard bench profile`): the phase clock, and the profile on a tiny model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from benchmark import profile
from benchmark.cli import main as bench_main
from benchmark.device_time import kernel_time
from benchmark.profile import HardwareFloor, ProfileRun, StepProfile, run_profile
from engine.observe.phases import PHASES, StepPhases
from tests.engine_harness import Req, drive, greedy, make_engine
from tests.models_fixtures import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("profile-model"))


def test_step_phases_add_up_to_the_step_and_run_syncs_at_each_mark(model_dir) -> None:
    engine = make_engine(model_dir, "paged")
    syncs = []
    phases = StepPhases(sync=lambda: syncs.append(1))
    engine.measure_phases(phases)
    engine.add_request("r", [5, 6, 7, 8], greedy(3))
    engine.step()
    assert list(phases.seconds) == list(PHASES)
    assert all(seconds >= 0 for seconds in phases.seconds.values())
    assert len(syncs) == 1 + len(PHASES)  # start, then every mark


def test_measuring_phases_does_not_change_the_tokens(model_dir) -> None:
    runs = []
    for phases in (None, StepPhases()):
        engine = make_engine(model_dir, "paged")
        if phases is not None:
            engine.measure_phases(phases)
        reqs = [Req(f"r{i}", [5 + i, 6, 7, 8], greedy(6)) for i in range(3)]
        drive(engine, reqs)
        runs.append([r.tokens for r in reqs])
    assert runs[0] == runs[1]


def test_profile_reports_prefill_and_decode_per_batch_size(model_dir) -> None:
    run = run_profile(model_dir, [1, 3], steps=2, warmup=1, dtype="float32", device="cpu")
    assert [(r.kind, r.batch) for r in run.rows] == [
        ("prefill", 1), ("decode", 1), ("mixed", 2), ("prefill", 3), ("decode", 3), ("mixed", 4)]
    decode = [r for r in run.rows if r.kind == "decode"]
    assert [r.tokens for r in decode] == [1, 3] and all(r.steps == 2 for r in decode)
    assert run.rows[3].tokens == 3 * run.prompt_tokens  # three prompts in one prefill step
    mixed = [r for r in run.rows if r.kind == "mixed"]  # a new prompt beside the decodes
    assert [r.tokens for r in mixed] == [run.prompt_tokens + 1, run.prompt_tokens + 3]
    for row in run.rows:
        assert set(row.phases_ms) == set(PHASES) and row.phases_ms["forward"] > 0
        assert row.host_us_per_seq > 0 and row.device_busy_ms is None  # no CUDA here
        detokenize_us = 1000 * row.phases_ms["detokenize"] / row.batch
        assert row.core_us_per_seq == pytest.approx(row.host_us_per_seq - detokenize_us)
    assert run.device == "cpu" and run.dtype == "float32"
    # the backend its steps used; no HBM bandwidth on the CPU, so no floor
    assert run.attention_backend in ("cpu_paged", "reference")
    assert run.hbm_bytes_per_s is None and all(r.floor_ms is None for r in run.rows)
    assert all(r.floor_ratio is None for r in run.rows)


def test_the_floor_reads_the_weights_once_and_each_sequences_kv(model_dir) -> None:
    """floor_ms = (weights + K/V of every sequence's context) / bandwidth; on the tiny model
    (2 layers, 2 KV heads of 16, float32: 512 bytes of K and V per position) whose weights
    are its checkpoint's bytes, at 1 GB/s."""
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        checkpoint = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    run = run_profile(model_dir, [2], steps=2, warmup=0, dtype="float32", device="cpu",
                      attention_backend="reference", hbm_bandwidth=1e9)
    assert run.attention_backend == "reference" and run.hbm_bytes_per_s == 1e9
    assert run.weight_bytes == checkpoint
    prefill, decode, mixed = run.rows
    p = run.prompt_tokens
    # after the prefill step (P + 1 tokens), the decode that ends the prefill pass and the
    # 2 phase-split steps, the timed pass reads P + 4 and P + 5 positions per sequence
    assert decode.kv_tokens == 2 * (p + 4.5)
    # the mixed pass's decodes read P + 6 and P + 7; the new prompt's chunk, its P
    assert mixed.kv_tokens == 2 * (p + 6.5) + p
    assert prefill.floor_ms is None  # compute bounds a prefill, not bandwidth
    for row in (decode, mixed):
        assert row.floor_ms == pytest.approx(1000 * (checkpoint + 512 * row.kv_tokens) / 1e9)
        assert row.floor_ratio == pytest.approx(row.step_ms / row.floor_ms)


def test_windowed_layers_read_at_most_their_window() -> None:
    floor = HardwareFloor(1000, 10, (None, 4), 1e6)
    assert floor.kv_bytes([3, 8]) == 10 * ((3 + 8) + (3 + 4))
    assert floor.ms([3, 8]) == pytest.approx(1000 * (1000 + 180) / 1e6)


@pytest.mark.parametrize(("name", "bandwidth"), [
    ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA H200", 4.8e12), ("Tesla T4", None)])
def test_the_bandwidth_comes_from_the_cards_name(monkeypatch, name, bandwidth) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert profile.hbm_bandwidth_of(torch.device("cuda", 0)) == bandwidth
    assert profile.hbm_bandwidth_of(torch.device("cuda", 0), 1e12) == 1e12  # an override wins
    assert profile.hbm_bandwidth_of(torch.device("cpu")) is None


@pytest.mark.parametrize("ahead", ["false", "true"])
def test_bench_profile_writes_its_table_and_json(model_dir, tmp_path, capsys, ahead) -> None:
    code = bench_main(["profile", "--model-dir", str(model_dir), "--batch-sizes", "2",
                       "--steps", "2", "--warmup", "0", "--dtype", "float32", "--device", "cpu",
                       "--async-scheduling", ahead, "--attention-backend", "reference",
                       "--hbm-bandwidth", "0.001", "--out", str(tmp_path)])
    assert code == 0
    assert "| decode | 2 | 2 |" in capsys.readouterr().out
    data = json.loads((tmp_path / "profile.json").read_text())
    assert [r["kind"] for r in data["rows"]] == ["prefill", "decode", "mixed"]
    assert data["attention_backend"] == "reference" and data["hbm_bytes_per_s"] == 1e9  # TB/s
    assert data["rows"][0]["floor_ratio"] is None and data["rows"][1]["floor_ratio"] > 0
    assert data["async_scheduling"] is (ahead == "true")
    text = (tmp_path / "profile.md").read_text()
    assert "host us/seq | core us/seq" in text and "core_us_per_seq" in data["rows"][1]
    assert "host us/seq" in text and f"scheduling {'on' if ahead == 'true' else 'off'}" in text
    assert "attention reference, floor at 0.001 TB/s" in text and "| floor ms | floor x |" in text


def test_profile_takes_a_synthetic_prompt_and_says_which_steps_replayed_a_graph(
        model_dir, tmp_path, monkeypatch) -> None:
    """--prompt-tokens: random words of exactly that many tokens; every row says what share of
    its steps replayed a CUDA graph (none on CPU; a stand-in graph replays every other step)."""
    engine = SimpleNamespace(  # what the engine and its model runner say of a step
        last_batch=SimpleNamespace(num_prefill_tokens=3, num_decode_tokens=2),
        runner=SimpleNamespace(last_step_graph=True))
    step = profile._measured(engine, SimpleNamespace(seconds={"forward": 0.5}))
    assert step == profile.MeasuredStep(5, {"forward": 0.5}, True)
    replays = iter([True, False] * 100)
    measured = profile._measured
    monkeypatch.setattr(profile, "_measured", lambda engine, phases: measured(
        engine, phases)._replace(graph=next(replays)))
    run = run_profile(model_dir, [2], steps=2, warmup=0, dtype="float32", device="cpu",
                      prompt_tokens=40, enforce_eager=True)
    assert run.prompt_tokens == 40 and run.enforce_eager
    decode = next(r for r in run.rows if r.kind == "decode")
    assert decode.steps == 2 and decode.graph_share == 0.5
    monkeypatch.undo()
    assert bench_main(["profile", "--model-dir", str(model_dir), "--batch-sizes", "2",
                       "--steps", "2", "--warmup", "0", "--dtype", "float32", "--device", "cpu",
                       "--prompt-tokens", "30", "--enforce-eager", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data["prompt_tokens"] == 30 and data["enforce_eager"] is True
    assert all(r["graph_share"] == 0.0 for r in data["rows"])  # CPU: no graphs
    text = (tmp_path / "profile.md").read_text()
    assert "30-token prompts" in text and "every step eager" in text and "| graphs |" in text


def test_a_prompt_longer_than_the_token_budget_is_profiled_by_its_first_chunk(tmp_path) -> None:
    """Paged batching's 512-token step budget: the long prompt's mixed step is its first chunk
    beside the decode (profiled, not refused)."""
    path = build_tiny_model(tmp_path / "long", max_position_embeddings=1024)
    run = run_profile(path, [1], steps=1, warmup=0, dtype="float32", device="cpu",
                      prompt_tokens=600)
    prefill, decode, mixed = run.rows
    assert prefill.steps == 2 and prefill.tokens == (512 + 88) // 2  # median of the chunks
    assert (decode.tokens, mixed.kind, mixed.tokens) == (1, "mixed", 512)


def test_on_a_device_decode_and_mixed_rows_carry_their_kernel_time(model_dir,
                                                                   monkeypatch) -> None:
    """Where a device sync exists (CUDA), the decode steps and a second pass of mixed steps
    run under the kernel clock, `steps` engine steps each; prefill rows carry none. Stood in
    on CPU by a no-op sync and a kernel clock that runs the work and counts its steps."""
    passes = []

    def kernel_clock(work, steps, top=8):
        passes.append((steps, len(work())))
        return 1.5 * len(passes), (("gemm", 900.0, 16.0),)

    monkeypatch.setattr(profile, "device_sync", lambda device: lambda: None)
    monkeypatch.setattr(profile, "device_busy", kernel_clock)
    run = run_profile(model_dir, [2], steps=3, warmup=0, dtype="float32", device="cpu")
    prefill, decode, mixed = run.rows
    assert passes == [(3, 3), (3, 3)]  # decode, then mixed: each ran its 3 steps
    assert prefill.device_busy_ms is None
    assert decode.device_busy_ms == 1.5 and decode.top_kernels[0][0] == "gemm"
    assert (mixed.device_busy_ms, mixed.steps) == (3.0, 3)  # the timed pass's steps
    assert mixed.top_kernels == (("gemm", 900.0, 16.0),)


def test_triton_is_imported_for_the_engines_device_before_the_tokenizer(model_dir,
                                                                        monkeypatch) -> None:
    """Triton interprets or compiles from its first import on, and transformers' tokenizer
    imports it (compiled, through torch._dynamo): asked for triton, the profile imports it for
    the engine's device first (here stood in, and stopped before the engine starts)."""
    from engine.kernels import triton_setup

    def tokenizer(*args, **kwargs):
        raise RuntimeError("stop")

    imported = []
    monkeypatch.setattr(triton_setup, "import_triton", imported.append)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", tokenizer)
    with pytest.raises(RuntimeError, match="stop"):
        run_profile(model_dir, [1], device="cpu", attention_backend="triton")
    assert imported == [torch.device("cpu")]


def test_bench_profile_refuses_bad_batch_sizes(capsys) -> None:
    assert bench_main(["profile", "--batch-sizes", "0"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert bench_main(["profile", "--prompt-tokens", "1"]) == 2
    assert "--prompt-tokens must be >= 2, got 1" in capsys.readouterr().err
    assert bench_main(["profile", "--hbm-bandwidth", "0"]) == 2
    assert "--hbm-bandwidth must be > 0 (TB/s), got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["profile", "--attention-backend", "fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


def test_a_cuda_profile_lists_the_largest_decode_and_mixed_batchs_kernels(tmp_path) -> None:
    """On CUDA each decode and mixed row carries torch.profiler's top kernels; the saved profile
    lists those of the largest batch of each kind (CPU profiles carry none and list nothing)."""
    def decode(batch, kernels, kind="decode"):
        return StepProfile(kind, batch, batch, 4, 3.0, {"forward": 2.0}, 2.5, kernels)

    rows = [decode(1, (("gemv", 900.0, 16.0),)), decode(32, (("gemm_bf16", 1500.5, 16.0),
                                                              ("flash_fwd", 300.0, 16.0))),
            decode(2, (("triton_tem_fused", 70.0, 16.0),), "mixed"),
            decode(33, (("triton_flex", 8000.0, 16.0),), "mixed")]
    ProfileRun("m", "cuda:0", "bfloat16", "paged", 9, rows).save(tmp_path)
    text = (tmp_path / "profile.md").read_text()
    assert "decode step at batch 32, per step" in text
    assert "1500.5 µs, 16 launches: `gemm_bf16`" in text and "gemv" not in text
    assert "mixed step at batch 33, per step" in text
    assert "8000.0 µs, 16 launches: `triton_flex`" in text and "triton_tem" not in text
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data["rows"][1]["top_kernels"][1] == ["flash_fwd", 300.0, 16.0]
    ProfileRun("m", "cpu", "float32", "paged", 9, [decode(8, ())]).save(tmp_path)
    assert "Kernels" not in (tmp_path / "profile.md").read_text()


def test_device_busy_counts_each_kernel_once() -> None:
    """A host op's self device time repeats the kernels it launched: only device events count."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device, us, count=4):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=us,
                               count=count)
    events = [event("aten::mm", DeviceType.CPU, 800.0), event("gemm", DeviceType.CUDA, 800.0),
              event("cudaGraphLaunch", DeviceType.CPU, 0.0), event("argmax", DeviceType.CUDA,
                                                                     40.0, 8)]
    busy_ms, top = kernel_time(events, DeviceType.CUDA, steps=4, top=1)
    assert busy_ms == pytest.approx(0.21) and top == (("gemm", 200.0, 1.0),)
