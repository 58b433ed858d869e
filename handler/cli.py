"""`batchyard` command line: serve, build-default-model, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from handler.properties import ConfigError, collect_settings, model_id_setting

logger = logging.getLogger("batchyard")

DEFAULT_PORT = 8080


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from benchmark.cli import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "build-default-model":
        from handler.default_model import main as build_main

        return build_main(argv[1:])
    parser = argparse.ArgumentParser(prog="batchyard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the SageMaker-compatible server")
    serve.add_argument("--properties", type=Path, help="serving.properties file to use")
    serve.add_argument("--model-dir", type=Path, help="model folder (default: /opt/ml/model, "
                       "else the embedded default model)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, help="default: $SAGEMAKER_BIND_TO_PORT or 8080")
    sub.add_parser("build-default-model", help="convert the embedded default model once")
    sub.add_parser("bench", help="load generator (see `batchyard bench --help`)")
    args = parser.parse_args(argv)
    return run_serve(args)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, prepare = resolve_config(args, os.environ)
    except (ConfigError, ValueError) as err:
        print(f"batchyard: configuration error: {err}", file=sys.stderr)
        return 2
    logger.info("configuration: %s", config.describe())
    from handler.server import exit_on_load_failure, run_server
    from handler.state import ServerState

    port = args.port or int(os.environ.get("SAGEMAKER_BIND_TO_PORT") or DEFAULT_PORT)
    # Test-only hook: stretches the loading phase so that /ping 503 can be observed.
    delay = float(os.environ.get("BATCHYARD_TEST_LOAD_DELAY", "0"))
    threads = int(os.environ.get("BATCHYARD_HTTP_THREADS", "128"))
    run_server(lambda: ServerState(config, prepare, exit_on_load_failure, delay), args.host, port,
               threads)
    return 0


def resolve_config(args: argparse.Namespace, environ):
    """(ServingConfig, model preparation to run while loading or None); raises ConfigError."""
    from handler.default_model import default_model_dir, ensure_default_model
    from handler.model_store import SAGEMAKER_MODEL_DIR, resolve_model_dir
    from handler.serving_config import build_serving_config

    properties = args.properties or _env_path(environ, "BATCHYARD_PROPERTIES")
    if properties is None:
        candidate = (args.model_dir or SAGEMAKER_MODEL_DIR) / "serving.properties"
        properties = candidate if candidate.is_file() else None
    settings = collect_settings(properties, environ)
    cache_dir = _env_path(environ, "BATCHYARD_CACHE_DIR")
    model_dir = resolve_model_dir(args.model_dir, model_id_setting(settings), cache_dir,
                                  build_default=False)
    prepare = None
    if model_dir == default_model_dir(cache_dir) and not (model_dir / "config.json").exists():
        prepare = lambda: ensure_default_model(cache_dir)  # noqa: E731  (built while /ping 503)
        architectures = ["LlamaForCausalLM"]
    else:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures", [])
    return build_serving_config(settings, model_dir, architectures), prepare


def _env_path(environ, name: str) -> Path | None:
    value = environ.get(name)
    return Path(value) if value else None


if __name__ == "__main__":
    raise SystemExit(main())
