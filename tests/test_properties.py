"""serving.properties parsing, precedence, strategy selection and one-line errors."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from handler.config.properties import ConfigError, collect_settings, parse_properties
from handler.config.serving_config import build_serving_config

LLAMA = ["LlamaForCausalLM"]
PROPERTIES_D = Path(__file__).resolve().parent.parent / "serving.properties.d"


def resolve(text: str = "", env: dict | None = None, arch=LLAMA, tmp_path: Path | None = None):
    settings = dict(collect_settings(None, env or {}))
    settings.update(parse_properties(text, "serving.properties"))
    return build_serving_config(settings, Path("/models/m"), arch)


def test_java_properties_syntax() -> None:
    """=, :, whitespace separators, comments, continuation and escapes."""
    text = ("# comment\n! also a comment\n\nengine = Python\noption.dtype: fp32\n"
            "batch_size 4\noption.model_id=/opt/ml/\\\n    model\nkey\\=x=a\\tb\n")
    s = parse_properties(text, "f")
    assert s["engine"].value == "Python" and s["option.dtype"].value == "fp32"
    assert s["batch_size"].value == "4" and s["option.model_id"].value == "/opt/ml/model"
    assert s["key=x"].value == "a\tb"
    assert s["option.model_id"].source == "f line 7"


def test_precedence_default_serving_option_file() -> None:
    """Built-in < SERVING_* < OPTION_* / aliases < the properties file."""
    assert resolve().job_queue_size == 1000
    assert resolve(env={"SERVING_JOB_QUEUE_SIZE": "5"}).job_queue_size == 5
    env = {"SERVING_BATCH_SIZE": "4", "OPTION_ROLLING_BATCH": "scheduler"}
    with pytest.raises(ConfigError):  # batch_size > 1 with rolling batch from env
        resolve(env=env)
    cfg = resolve("option.max_rolling_batch_size=7",
                  env={"OPTION_ROLLING_BATCH": "scheduler", "OPTION_MAX_ROLLING_BATCH_SIZE": "3"})
    assert cfg.engine.max_num_seqs == 7
    assert resolve(env={"OPTION_ROLLING_BATCH": "scheduler",
                        "OPTION_MAX_ROLLING_BATCH_SIZE": "3"}).engine.max_num_seqs == 3


def test_tgi_aliases_apply_only_when_lmi_variable_unset() -> None:
    env = {"OPTION_ROLLING_BATCH": "scheduler", "MAX_BATCH_SIZE": "9",
           "MAX_CONCURRENT_REQUESTS": "11", "HF_MODEL_ID": "/m"}
    cfg = resolve(env=env)
    assert (cfg.engine.max_num_seqs, cfg.job_queue_size, cfg.model_id) == (9, 11, "/m")
    cfg = resolve(env={**env, "OPTION_MAX_ROLLING_BATCH_SIZE": "4"})
    assert cfg.engine.max_num_seqs == 4
    assert "env HF_MODEL_ID" in cfg.settings["option.model_id"].source


@pytest.mark.parametrize(("text", "arch", "strategy"), [
    ("", LLAMA, "none"),
    ("batch_size=8", LLAMA, "dynamic"),
    ("option.rolling_batch=disable\nbatch_size=8", LLAMA, "dynamic"),
    ("option.rolling_batch=scheduler", LLAMA, "continuous"),
    ("rolling_batch=scheduler", LLAMA, "continuous"),
    ("option.rolling_batch=vllm", LLAMA, "paged"),
    ("option.rolling_batch=lmi-dist", LLAMA, "paged"),
    ("option.rolling_batch=lmi-dist\noption.paged_attention=false", LLAMA, "continuous"),
    ("option.rolling_batch=paged", LLAMA, "paged"),
    ("option.rolling_batch=auto", LLAMA, "paged"),
    ("option.rolling_batch=auto", ["GPT2LMHeadModel"], "paged"),  # the transformers fallback
])
def test_strategy_selection(text, arch, strategy) -> None:
    assert resolve(text, arch=arch).engine.batching == strategy


def test_max_num_seqs_follows_the_strategy() -> None:
    assert resolve("").engine.max_num_seqs == 1
    assert resolve("batch_size=6").engine.max_num_seqs == 6
    assert resolve("option.rolling_batch=scheduler").engine.max_num_seqs == 32


def test_rolling_batch_with_batch_size_is_an_error() -> None:
    with pytest.raises(ConfigError, match="batch_size='4'.*cannot be combined"):
        resolve("batch_size=4\noption.rolling_batch=scheduler")


@pytest.mark.parametrize(("text", "key"), [
    ("option.max_rolling_batch_size=abc\noption.rolling_batch=scheduler",
     "option.max_rolling_batch_size='abc'"),
    ("option.dtype=int8", "option.dtype='int8'"),
    ("max_batch_delay=-1", "max_batch_delay='-1'"),
    ("option.rolling_batch=turbo", "option.rolling_batch='turbo'"),
    ("option.enable_prefix_caching=yes", "option.enable_prefix_caching='yes'"),
    ("option.tensor_parallel_degree=0", "option.tensor_parallel_degree='0'"),
    ("option.tensor_parallel_degree=two", "option.tensor_parallel_degree='two'"),
    ("option.kv_cache_memory=lots", "option.kv_cache_memory='lots'"),
    ("option.max_model_len=0", "option.max_model_len='0'"),
    ("option.linear_backend=blas", "option.linear_backend='blas'"),
    ("option.async_scheduling=yes", "option.async_scheduling='yes'"),
    ("option.cudagraph_mode=piecewise", "option.cudagraph_mode='piecewise'"),
    ("option.api_server_count=0", "option.api_server_count='0'"),
    ("option.api_server_count=65", "option.api_server_count='65'"),
    ("option.api_server_count=2\noption.engine_process=false", "option.api_server_count='2'"),
    ("option.api_server_count=2\noption.entryPoint=my_handler",
     "option.api_server_count='2'"),
    ("option.api_server_nice=20", "option.api_server_nice='20'"),
    ("option.api_server_nice=-1", "option.api_server_nice='-1'"),
    ("option.api_server_nice=low", "option.api_server_nice='low'"),
    ("option.api_server_nice=5\noption.engine_process=false", "option.api_server_nice='5'"),
])
def test_bad_values_name_key_value_source_and_allowed(text, key) -> None:
    with pytest.raises(ConfigError) as err:
        resolve(text)
    message = str(err.value)
    assert key in message and "serving.properties line" in message and "expected" in message
    assert "\n" not in message


def test_api_server_count_shares_one_core_and_keeps_lmi_handlers() -> None:
    assert resolve().api_server_count == 1
    cfg = resolve("option.api_server_count=4")
    assert cfg.api_server_count == 4 and "api_server_count=4" in cfg.describe()
    # LMI's own handler names the built-in engine: several HTTP processes are fine.
    assert resolve("option.api_server_count=2\noption.entryPoint=djl_python.lmi_vllm."
                   "vllm_async_service").api_server_count == 2


def test_api_server_nice_is_auto_unless_set() -> None:
    assert resolve().api_server_nice is None and "api_server_nice" not in resolve().describe()
    assert resolve("option.api_server_nice=AUTO").api_server_nice is None
    cfg = resolve("option.api_server_nice=7")
    assert cfg.api_server_nice == 7 and "api_server_nice=7" in cfg.describe()
    assert resolve("option.api_server_nice=0\noption.engine_process=false").api_server_nice == 0


def test_sizes_and_types() -> None:
    cfg = resolve("option.rolling_batch=paged\noption.kv_cache_memory=1.5GiB\n"
                  "option.dtype=bf16\noption.max_request_size=2MB\noption.predict_timeout=9.5")
    assert cfg.engine.kv_cache_memory == int(1.5 * 2**30)
    assert cfg.engine.dtype == "bfloat16" and cfg.max_request_bytes == 2_000_000
    assert cfg.predict_timeout == 9.5
    assert cfg.engine.linear_backend == "auto"
    assert resolve("option.linear_backend=aten").engine.linear_backend == "aten"
    assert resolve("").engine.async_scheduling is None  # auto: on with CUDA
    assert resolve("option.async_scheduling=true").engine.async_scheduling is True
    assert resolve("option.async_scheduling=FALSE").engine.async_scheduling is False
    assert resolve("").engine.cudagraph_mode == "full_and_piecewise"  # vLLM's default mode
    assert resolve("option.cudagraph_mode=FULL").engine.cudagraph_mode == "full"


def test_unknown_keys_warn_and_lmi_no_op_keys_say_why(caplog) -> None:
    with caplog.at_level(logging.INFO):
        resolve("engine=Python\noption.entryPoint=djl_python.huggingface\noption.flux=1")
    assert any("unknown key" in r.message and "option.flux [serving.properties line 3]"
               in r.message and r.levelno == logging.WARNING for r in caplog.records)
    assert any("engine=Python" in r.message and "has no effect" in r.message
               for r in caplog.records)


@pytest.mark.parametrize("typo", [
    "option.max_rolling_batchsize", "option.max_model_length", "option.tensor_parralel_degree",
    "option.enable_prefix_cache", "option.gpu_memory_utilisation", "option.rolling_bacth",
    "option.trust_remote_cod", "option.outputformatter", "option.max_rolling_batch_prefil_tokens"])
def test_a_near_miss_key_is_refused_with_its_suggestion(typo: str) -> None:
    with pytest.raises(ConfigError, match=r"did you mean option\.\w+\?") as err:
        resolve(f"{typo}=8")
    assert typo in str(err.value) and "\n" not in str(err.value)


def test_a_near_miss_key_names_the_key_it_meant() -> None:
    with pytest.raises(ConfigError, match=r"unknown key option\.max_rolling_batchsize='8' \(from "
                       r"serving.properties line 1\): did you mean "
                       r"option\.max_rolling_batch_size\?"):
        resolve("option.max_rolling_batchsize=8")
    with pytest.raises(ConfigError, match=r"env OPTION_MAX_ROLLING_BATCHSIZE.*did you mean "
                       r"OPTION_MAX_ROLLING_BATCH_SIZE \(option\.max_rolling_batch_size\)\?"):
        resolve(env={"OPTION_MAX_ROLLING_BATCHSIZE": "8"})


# Keys of LMI's other backends (vLLM, lmi-dist, TensorRT-LLM, Neuron, DeepSpeed, HF accelerate)
# and of DJL Serving, from docs/reference: an LMI user's file may carry any of them.
OTHER_BACKENDS = (
    "option.max_input_len", "option.max_output_len", "option.max_num_tokens",
    "option.max_num_seqs", "option.max_num_batched_tokens", "option.swap_space",
    "option.kv_cache_dtype", "option.quantization", "option.tokenizer_mode",
    "option.load_format", "option.max_seq_len_to_capture", "option.disable_custom_all_reduce",
    "option.pipeline_parallel_size", "option.tensor_parallel_size", "option.max_logprobs",
    "option.code_revision", "option.tokenizer_revision", "option.cpu_offload_gb",
    "option.preemption_mode", "option.num_gpu_blocks_override", "option.speculative_model",
    "option.num_speculative_tokens", "option.draft_model_id",
    "option.served_model_name", "option.tokenizer", "option.max_parallel_loading_workers",
    "option.batch_scheduler_policy", "option.kv_cache_free_gpu_mem_fraction",
    "option.enable_kv_cache_reuse", "option.n_positions", "option.neuron_optimize_level",
    "option.context_length_estimate", "option.load_in_8bit", "option.load_in_4bit",
    "option.low_cpu_mem_usage", "option.rolling_batch_strategy", "option.checkpoint",
    "option.save_mp_checkpoint_path", "option.max_tokens", "option.triangular_masking",
    "option.return_tuple", "option.training_mp_size", "option.disable_flash_attn",
    "option.chat_template", "option.enable_auto_tool_choice", "option.tool_call_parser",
    "option.reasoning_parser", "option.limit_mm_per_prompt", "option.is_peft_model",
    "option.max_dynamic_batch_size", "option.amp_dtype", "option.enable_cuda_graph",
    "option.disable_sliding_window", "option.group_query_attention", "option.engine_args",
    "option.use_custom_all_reduce", "option.hf_token", "option.device_id", "option.unroll",
    "option.compiled_graph_path", "option.load_split_model", "option.fuse_qkv",
    "option.sequence_parallel", "option.partition_schema", "option.enable_expert_parallel",
    "option.max_batch_size", "option.kv_cache_memory_bytes", "option.multi_node",
    "option.distributed_executor_backend", "option.guided_decoding_backend",
    "gpu.minWorkers", "gpu.maxWorkers", "cpu.maxWorkers", "max_dynamic_batch_size",
    "required_memory_mb", "reserved_memory_mb", "log_model_metric", "metrics_aggregation",
    "retry_threshold", "max_workers", "min_workers",
    # DJL's bare keys as OPTION_* variables make (found in review: option.engine matched
    # the bare `engine` exactly and was refused)
    "option.engine", "option.load_on_devices", "option.max_idle_time",
)


def test_other_backends_keys_are_accepted_and_listed_on_one_line(caplog) -> None:
    text = "\n".join(f"{k}=1" for k in OTHER_BACKENDS)
    with caplog.at_level(logging.INFO):
        resolve(text)
    lines = [r for r in caplog.records if "unknown key" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    for key in OTHER_BACKENDS:
        assert f"{key} [serving.properties line" in lines[0].getMessage(), key
    assert "=1" not in lines[0].getMessage()  # no values: a key may hold a secret


def test_lmi_reference_keys_are_never_refused() -> None:
    reference = Path("/work/shared/reference/lmi-conventions.md")
    if not reference.exists():
        pytest.skip("the LMI reference is not on this machine")
    keys = set(re.findall(r"option\.[A-Za-z_0-9]+", reference.read_text()))
    assert len(keys) > 20
    resolve("\n".join(f"{k}=1" for k in keys if k not in NON_NUMERIC))
    for key in keys:  # each alone, with a value the key accepts
        resolve(f"{key}={NON_NUMERIC.get(key, '1')}")


# Known keys whose value must not be `1` in the test above.
NON_NUMERIC = {"option.rolling_batch": "scheduler", "option.dtype": "fp16",
               "option.entryPoint": "djl_python.huggingface", "option.handler": "handle",
               "option.output_formatter": "json", "option.task": "text-generation",
               "option.device_map": "auto", "option.quantize": "none",
               "option.enable_streaming": "false", "option.model_id": "/m",
               "option.trust_remote_code": "false", "option.paged_attention": "true",
               "option.enforce_eager": "false", "option.enable_chunked_prefill": "true",
               "option.enable_prefix_caching": "false", "option.tgi_compat": "false",
               "option.mpi_mode": "true", "option.async_mode": "true",
               "option.parallel_loading": "true", "option.max_model_len": "64",
               "option.gpu_memory_utilization": "0.9"}


def test_describe_lists_every_value_and_source() -> None:
    line = resolve("option.rolling_batch=scheduler").describe()
    assert "strategy=continuous" in line and "serving.properties line 1" in line


@pytest.mark.parametrize(("name", "strategy"), [
    ("none", "none"), ("dynamic", "dynamic"), ("continuous", "continuous"), ("paged", "paged"),
    ("paged-prefix", "paged"), ("paged-unchunked", "paged")])
def test_shipped_properties_files_parse(name, strategy) -> None:
    settings = collect_settings(PROPERTIES_D / f"{name}.properties", {})
    assert build_serving_config(settings, Path("/m"), LLAMA).engine.batching == strategy


@pytest.mark.parametrize(("text", "env", "size"), [
    ("", {}, 1),
    ("option.tensor_parallel_degree=2", {}, 2),
    ("option.tensor_parallel_degree=max", {}, -1),
    ("option.tensor_parallel_degree=-1", {}, -1),
    ("", {"SM_NUM_GPUS": "4"}, 4),  # TGI/SageMaker's variable, as LMI honours it
    ("option.tensor_parallel_degree=2", {"SM_NUM_GPUS": "4"}, 2),  # the file wins
])
def test_tensor_parallel_degree_and_sm_num_gpus(text, env, size) -> None:
    assert resolve(text, env=env).engine.tensor_parallel_size == size


def readme_config_keys() -> list[str]:
    """Every key of the README's configuration table."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = text[text.index("| key | default | meaning |"):]
    rows = table[:table.index("\n\n")].splitlines()[2:]
    return [key for row in rows for key in re.findall(r"`([\w.]+)`", row.split("|")[1])]


# option.model_id is checked where the model folder is resolved (tests/test_model_store.py).
@pytest.mark.parametrize("key", [k for k in readme_config_keys() if k != "option.model_id"])
def test_every_documented_key_refuses_a_bad_value_in_one_line(key) -> None:
    """A value no key accepts stops start-up before any model is touched, with one line naming
    the key, the value, where it came from and what is allowed."""
    rolling = "" if key == "option.rolling_batch" else "option.rolling_batch=paged\n"
    with pytest.raises(ConfigError) as err:
        resolve(f"{rolling}{key}=-7.5x")
    message = str(err.value)
    assert f"{key}='-7.5x'" in message and "serving.properties line" in message
    assert "\n" not in message
