"""Every LMI key batchyard does not act on is a logged no-op or refused at start-up; the
migration keys (entry point, formatters, tgi_compat, maxWorkers) are read and checked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from handler.config.key_policy import NO_OP_KEYS, REFUSED_KEYS
from handler.config.properties import ConfigError, collect_settings, parse_properties
from handler.config.serving_config import build_serving_config


def resolve(text: str = "", env: dict | None = None, model_dir: Path = Path("/models/m")):
    settings = dict(collect_settings(None, env or {}))
    settings.update(parse_properties(text, "serving.properties"))
    return build_serving_config(settings, model_dir, ["LlamaForCausalLM"])


@pytest.mark.parametrize(("line", "instead"), [
    ("option.quantize=bitsandbytes", "config.json"),
    ("option.quantize=squeezellm", "compressed-tensors"),
    ("option.lora_dtype=float16", "base model's dtype"),
    ("option.long_lora_scaling_factors=3.0", "option.max_lora_rank"),
    ("option.adapters=a", "<model dir>/adapters"),
    ("option.enable_streaming=true", "output_formatter=jsonlines"),
    ("option.device_map=balanced", "option.device"),
    ("option.task=text-embedding", "text-generation"),
    ("engine=OnnxRuntime", "Python, MPI or DeepSpeed"),
    ("option.pipeline_parallel_degree=2", "remove the key"),
])
def test_refused_keys_name_key_and_alternative(line: str, instead: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve(line)
    message = str(err.value)
    key = line.split("=")[0]
    assert key in message and instead in message and "serving.properties line 1" in message
    assert "\n" not in message


def test_quantize_from_tgi_env_is_refused_too() -> None:
    with pytest.raises(ConfigError, match="option.quantize.*env HF_MODEL_QUANTIZE"):
        resolve(env={"HF_MODEL_QUANTIZE": "bitsandbytes"})


@pytest.mark.parametrize("line", ["option.enable_lora=false", "option.lora_dtype=auto",
                                  "option.quantize=",
                                  "option.quantize=none", "option.quantize=int8",
                                  "option.quantize=fp8", "option.quantize=awq",
                                  "option.quantize=gptq_marlin",
                                  "option.quantize=compressed-tensors",
                                  "option.enable_streaming=false", "engine=MPI",
                                  "option.device_map=auto", "option.task=text-generation"])
def test_values_that_leave_a_feature_off_are_accepted(line: str) -> None:
    resolve(line)


def test_no_op_keys_log_their_reason(caplog) -> None:
    text = "\n".join(f"{k}=auto" if k == "option.device_map" else
                     f"{k}={'Python' if k == 'engine' else 'text-generation'}"
                     for k in NO_OP_KEYS)
    with caplog.at_level(logging.INFO):
        resolve(text)
    for key, rule in NO_OP_KEYS.items():
        assert any(key in r.message and rule.why in r.message for r in caplog.records), key
    assert not any("unknown key" in r.message for r in caplog.records)


def test_no_key_is_both_a_no_op_and_refused() -> None:
    assert not set(NO_OP_KEYS) & set(REFUSED_KEYS)


def test_migration_keys_are_read() -> None:
    cfg = resolve("option.entryPoint=model.py\noption.handler=predict\nmaxWorkers=4\n"
                  "option.output_formatter=jsonlines\noption.input_formatter=my_input")
    lmi = cfg.lmi
    assert (lmi.entry_point, lmi.handler, lmi.max_workers) == ("model.py", "predict", 4)
    assert (lmi.output_formatter, lmi.input_formatter, lmi.tgi_compat) == (
        "jsonlines", "my_input", False)
    assert resolve("option.tgi_compat=true").lmi.output_formatter == "tgi"
    assert resolve("option.output_formatter=tgi").lmi.tgi_compat
    assert resolve(env={"DJL_ENTRY_POINT": "my_module"}).lmi.entry_point == "my_module"
    assert resolve(env={"OPTION_ENTRYPOINT": "a.b"}).lmi.entry_point == "a.b"
    assert resolve("maxWorkers=-1").lmi.max_workers == 1


@pytest.mark.parametrize("value", ["../escape.py", "/etc/passwd.py", "sub/../../x.py",
                                   "not a module"])
def test_entry_point_outside_the_model_folder_is_refused(value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="option.entryPoint"):
        resolve(f"option.entryPoint={value}", model_dir=tmp_path)


@pytest.mark.parametrize(("line", "key"), [("option.output_formatter=x-y", "output_formatter"),
                                           ("option.handler=1abc", "option.handler"),
                                           ("maxWorkers=1000", "maxWorkers")])
def test_bad_migration_values_are_refused(line: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        resolve(line)


def test_quantize_int8_reaches_the_engine() -> None:
    assert resolve("option.quantize=INT8").engine.quantize == "int8"
    assert resolve(env={"HF_MODEL_QUANTIZE": "int8"}).engine.quantize == "int8"
    assert resolve("option.quantize=none").engine.quantize is None


def test_the_lmi_v5_batching_notebook_properties_start() -> None:
    """The SMEX LMI-v5 notebook's files (one device instead of two) resolve as they are."""
    dynamic = ("engine = DeepSpeed\noption.entryPoint = djl_python.huggingface\n"
               "batch_size = 64\nmax_batch_delay = 1000\noption.model_loading_timeout = 900\n")
    assert resolve(dynamic).engine.batching == "dynamic"
    rolling = ("engine = MPI\noption.entryPoint = djl_python.huggingface\n"
               "option.rolling_batch = auto\noption.max_rolling_batch_size = 64\n"
               "option.paged_attention = false\noption.max_rolling_batch_prefill_tokens = 16080\n"
               "option.model_loading_timeout = 900\n")
    cfg = resolve(rolling)
    assert cfg.engine.batching == "paged" and cfg.lmi.builtin_engine_requested


def test_speculative_keys_resolve_to_the_engine_fields(tmp_path) -> None:
    config = resolve("option.speculative_draft_model=ngram\noption.speculative_length=3").engine
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 3)
    config = resolve('option.speculative_config={"method": "ngram", "num_speculative_tokens": 4, '
                     '"prompt_lookup_max": 3, "disable_by_batch_size": 8}').engine
    assert (config.speculative_method, config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max, config.speculative_disable_batch_size) == (
        "ngram", 4, 3, 3, 8)
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    config = resolve(f"option.speculative_draft_model={tmp_path}/draft").engine
    assert (config.speculative_method, config.speculative_model) == ("draft_model",
                                                                      f"{tmp_path}/draft")
    config = resolve('option.speculative_config={"method": "draft_model", "model": "draft", '
                     '"num_speculative_tokens": 3}', model_dir=tmp_path).engine
    assert config.speculative_model == f"{tmp_path}/draft" and config.num_speculative_tokens == 3


@pytest.mark.parametrize(("line", "message"), [
    ("option.speculative_draft_model=../other/draft", "without '..'"),
    ("option.speculative_draft_model=s3://bucket/draft", "not downloaded"),
    ("option.speculative_draft_model=/opt/ml/nothing", "no model folder at /opt/ml/nothing"),
    ('option.speculative_config={"method": "eagle3", "model": "x"}', "EAGLE"),
    ('option.speculative_config={"method": "draft_model"}', "EAGLE"),
    ('option.speculative_config={"method": "ngram", "lookahead": 2}', "unknown field 'lookahead'"),
    ('option.speculative_config={"method": "ngram", "num_speculative_tokens": 0}',
     "num_speculative_tokens as a positive integer"),
    ("option.speculative_config=ngram", "a JSON object"),
    ('option.speculative_config={"method": "ngram", "num_speculative_tokens": 40}',
     "num_speculative_tokens"),
])
def test_speculative_keys_that_cannot_work_are_refused(line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(line)
