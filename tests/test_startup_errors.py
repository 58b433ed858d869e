"""Start-up configuration errors: one line naming the key, the value and the limit, no traceback,
found from config.json before any weights load (or tensor-parallel rank starts) wherever they
can be; an unexpected load failure keeps its traceback."""

from __future__ import annotations

import logging

import pytest

from engine import EngineConfig, is_config_error
from engine.runner import setup
from engine.runner.setup import check_before_load
from handler.config.serving_config import ServingConfig
from handler.http import state as state_module
from handler.http.state import ServerState
from tests.engine_harness import make_engine
from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

POSITIONS = 256  # build_tiny_model's max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("startup-errors"))


def config(path, batching: str = "paged", **overrides) -> EngineConfig:
    return EngineConfig(model=str(path), batching=batching, device="cpu", dtype="float32",
                        **overrides)


@pytest.mark.parametrize("tp", [1, 2])
def test_max_model_len_past_the_models_positions_is_found_before_loading(model_dir, tp) -> None:
    with pytest.raises(ValueError, match=rf"^invalid max_model_len=100000: must be <= the "
                                         rf"model's max_position_embeddings \({POSITIONS}\)$"):
        check_before_load(config(model_dir, max_model_len=100_000), tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_an_explicit_pool_without_room_for_one_sequence_is_found_before_loading(model_dir,
                                                                                 tp) -> None:
    """Contiguous strategies reserve max_model_len per sequence: a pool given by
    kv_cache_memory that holds less is refused from config.json alone (per rank's KV heads)."""
    per_token = 2 * 2 * (2 // tp) * 16 * 4  # K and V, 2 layers, this rank's KV heads, fp32
    with pytest.raises(ValueError, match=rf"^invalid max_model_len={POSITIONS}: the KV pool "
                                         rf"\(kv_cache_memory=10240\) holds {10240 // per_token} "
                                         rf"tokens, less than one block of {POSITIONS} tokens"):
        check_before_load(config(model_dir, "continuous", kv_cache_memory=10240), tp)
    # paged: a pool smaller than max_model_len serves what fits (requests say the limit)
    check_before_load(config(model_dir, kv_cache_memory=10240), tp)
    with pytest.raises(ValueError, match=r"^invalid block_size=16: the KV pool \(kv_cache_memory="):
        check_before_load(config(model_dir, kv_cache_memory=per_token), tp)


def test_the_engine_refuses_before_loading_any_weights(model_dir, monkeypatch) -> None:
    monkeypatch.setattr(setup, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match="invalid max_model_len=4096") as err:
        make_engine(model_dir, "paged", max_model_len=4096)
    assert is_config_error(err.value)


def test_a_config_error_is_logged_as_one_line_and_anything_else_with_its_traceback(
        model_dir, monkeypatch, caplog) -> None:
    failures = iter([ValueError("invalid max_model_len=9: must be <= 8"),
                     RuntimeError("something unexpected")])

    def failing(*args, **kwargs):
        raise next(failures)

    monkeypatch.setattr(state_module.EngineClient, "from_config", failing)
    for _ in range(2):
        state = ServerState(ServingConfig(engine=config(model_dir)))
        with caplog.at_level(logging.ERROR, logger="handler.http.state"):
            state._load()
        assert state.status == "failed"
    one_line, traced = caplog.records
    assert one_line.getMessage() == "model loading failed: invalid max_model_len=9: must be <= 8"
    assert one_line.exc_info is None and traced.exc_info is not None


@pytest.mark.parametrize("tp", [1, 2])
def test_the_server_exits_3_with_one_line_and_no_traceback(model_dir, tmp_path, tp) -> None:
    """The CLI, as deployed: a max_model_len past the model's positions ends start-up with exit
    3 and one line naming the key, the value and the limit; no weights are loaded and (tensor
    parallel on CPU) no worker rank is started first."""
    properties = ("option.rolling_batch=paged\noption.max_model_len=100000\noption.device=cpu\n"
                  f"option.tensor_parallel_degree={tp}\n")
    with running_server(tmp_path, model_dir, properties, wait_ready=False) as server:
        assert server.process.wait(timeout=120) == 3
        log = server.log()
    lines = [line for line in log.splitlines() if "max_model_len=100000:" in line]
    assert len(lines) == 1, log
    assert f"invalid max_model_len=100000: must be <= the model's max_position_embeddings " \
           f"({POSITIONS})" in lines[0]
    assert "Traceback" not in log and "loaded LlamaForCausalLM" not in log, log
    assert "tensor parallel: started" not in log, log
