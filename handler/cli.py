"""`batchyard` command line: serve, build-default-model, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from handler.config.properties import ConfigError, collect_settings, model_id_setting

if TYPE_CHECKING:
    from handler.http.state import ServerState

logger = logging.getLogger("batchyard")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # handler/http/metrics.py reads it

DEFAULT_PORT = 8080
HTTP_SPARE_THREADS = 16


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from benchmark.cli import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "deploy":
        from deploy.cli import main as deploy_main

        return deploy_main(argv[1:])
    if argv and argv[0] == "build-default-model":
        from handler.model_source.default_model import main as build_main

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
    worker = sub.add_parser("worker", help="a disaggregated prefill or decode worker for the "
                            "router of another host's `batchyard serve`")
    worker.add_argument("--router", required=True, help="HOST:PORT (its worker_port)")
    worker.add_argument("--model-dir", type=Path, help="this host's copy of the model "
                        "(default: the router's path)")
    worker.add_argument("--gpu", type=int, default=0, help="which of this host's GPUs (on CUDA)")
    args = parser.parse_args(argv)
    if args.command == "worker":
        return run_worker(args)
    return run_serve(args)


def run_worker(args: argparse.Namespace) -> int:
    """Join a router as the rank it assigns; the secret comes from $BATCHYARD_WORKER_KEY."""
    from engine import serve_remote_worker
    from handler.config.key_reads import WORKER_KEY_ENV

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = args.router.rpartition(":")
    key = os.environ.get(WORKER_KEY_ENV, "")
    if not host or not port.isdigit() or not key:
        print(f"batchyard worker: --router HOST:PORT and ${WORKER_KEY_ENV} are needed",
              file=sys.stderr)
        return 2
    model = str(args.model_dir) if args.model_dir is not None else None
    serve_remote_worker((host, int(port)), key.encode(), model, args.gpu)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, prepare = resolve_config(args, os.environ)
    except (ConfigError, ValueError) as err:
        print(f"batchyard: configuration error: {err}", file=sys.stderr)
        return 2
    logger.info("configuration: %s", config.describe())
    if config.engine_process:
        brief_openmp_spin(os.environ)
    core = None
    if config.api_server_count > 1:  # one core process prepares and loads for every worker
        from engine import CoreServer

        core = CoreServer(config.engine, prepare)
        prepare = None
        # Before prometheus_client is imported (it picks its storage then); in the core's
        # directory, which goes with it, even if this process is killed.
        os.environ[MULTIPROC_ENV] = core.scratch_dir("metrics")
    from handler.http.server import exit_on_engine_death, exit_on_load_failure, run_server
    from handler.http.state import ServerState

    port = args.port or int(os.environ.get("SAGEMAKER_BIND_TO_PORT") or DEFAULT_PORT)
    # Test-only hook: stretches the loading phase so that /ping 503 can be observed.
    delay = float(os.environ.get("BATCHYARD_TEST_LOAD_DELAY", "0"))
    # A thread per request in flight (running + job_queue_size) and a few for /ping and
    # /metrics, so that the queue, not the thread pool, is what turns requests away (503).
    spare = config.engine.max_num_seqs + config.job_queue_size + HTTP_SPARE_THREADS
    threads = int(os.environ.get("BATCHYARD_HTTP_THREADS") or spare)
    on_exit = core.stop if core is not None else None
    if core is not None:
        try:
            core.wait_listening()
        except RuntimeError as err:
            logger.error("%s", err)
            core.stop()
            return 3
    master = os.getpid()
    try:
        run_server(lambda: ServerState(config, prepare, exit_on_load_failure, delay,
                                       on_engine_death=exit_on_engine_death,
                                       core_address=core.address if core else None,
                                       before_ready=on_ready),
                   args.host, port, threads, config.drain_timeout, config.api_server_count,
                   on_exit)
    finally:  # also where gunicorn leaves without its on_exit hook (e.g. the port is taken);
        # not in a worker, whose exit unwinds this same (forked) stack
        if on_exit is not None and os.getpid() == master:
            on_exit()
    return 0


def on_ready(state: ServerState) -> None:
    """In each HTTP process, once its engine is up and before /ping says so."""
    from engine import freeze_start_up_heap
    from handler.cpu_priority import step_back_for_core

    freeze_start_up_heap()
    if state.serves_core_process():  # a core on a thread of this process would slow down too
        step_back_for_core(state.config.api_server_nice, state.config.api_server_count,
                           state.engine.gauges, state.config.engine.busy_step_sequences)


# Spins of libgomp's wait after a parallel region before its thread sleeps (~85 µs on a 2-vCPU
# EPYC): the gaps between one forward's regions, not the host's work between two steps.
CORE_OPENMP_SPIN_COUNT = 3000


def brief_openmp_spin(environ) -> None:
    """The engine core process (spawned later: it inherits `environ`) gets OpenMP threads that
    spin briefly after each parallel region, unless the user chose a wait policy. libgomp's
    default spin (300,000) starved the HTTP threads on 2 vCPUs: tokens reached clients in
    bursts. Sleeping at once (OMP_WAIT_POLICY=PASSIVE, the earlier default) paid a thread wake-up
    per region: the default model's batch-1 decode ran at 27 ms per token instead of 16 and
    served paged lost a quarter of its req/s (docs/benchmark/cpu-2026-11-27-openmp/)."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = str(CORE_OPENMP_SPIN_COUNT)


def resolve_config(args: argparse.Namespace, environ):
    """(ServingConfig, model preparation to run while loading or None); raises ConfigError.

    Needs no network: a model that is built (the default model) or downloaded (s3://) on first
    use is prepared by the returned callable in the loader thread, while /ping answers 503.
    """
    from engine import read_json_object
    from handler.config.serving_config import build_serving_config
    from handler.model_source.default_model import default_model_dir, ensure_default_model
    from handler.model_source.s3 import is_complete
    from handler.model_source.s3_layout import is_s3_uri
    from handler.model_source.store import SAGEMAKER_MODEL_DIR, resolve_model_dir

    properties = args.properties or _env_path(environ, "BATCHYARD_PROPERTIES")
    if properties is None:
        candidate = (args.model_dir or SAGEMAKER_MODEL_DIR) / "serving.properties"
        properties = candidate if candidate.is_file() else None
    settings = collect_settings(properties, environ)
    cache_dir = _env_path(environ, "BATCHYARD_CACHE_DIR")
    model_id = model_id_setting(settings)
    model_dir = resolve_model_dir(args.model_dir, model_id, cache_dir, fetch=False,
                                  has_handler=_has_handler(settings))
    prepare = None
    if args.model_dir is None and is_s3_uri(model_id) and not is_complete(model_dir):
        return _s3_config(settings, model_id, model_dir, cache_dir, environ)
    if model_dir == default_model_dir(cache_dir) and not (model_dir / "config.json").exists():
        prepare = partial(ensure_default_model, cache_dir)  # built while /ping answers 503
        architectures = ["LlamaForCausalLM"]
    else:  # a folder with only a custom handler may have no config.json
        config_json = model_dir / "config.json"
        architectures = read_json_object(config_json).get("architectures", []) if (
            config_json.is_file()) else []
    return build_serving_config(settings, model_dir, architectures), prepare


def _has_handler(settings) -> bool:
    """option.entryPoint names the user's own handler (not one of LMI's built-in ones)."""
    from handler.config.lmi_options import BUILTIN_ENTRY_POINTS

    entry = settings.get("option.entryPoint")
    return entry is not None and entry.value.strip() not in BUILTIN_ENTRY_POINTS


def _s3_config(settings, model_id: str, model_dir: Path, cache_dir: Path | None, environ):
    """An s3:// model not downloaded yet: its config.json is not read at start-up (that would
    delay binding the port by a network round trip, or fail it). Nothing in the configuration
    depends on it: option.rolling_batch=auto is paged for every architecture."""
    from handler.config.serving_config import build_serving_config
    from handler.model_source.s3 import download_model

    config = build_serving_config(settings, model_dir, [])  # the architecture: not known yet

    # A partial (not a closure): with api_server_count > 1 it runs in the core process.
    return config, partial(download_model, model_id, cache_dir, dict(environ))


def _env_path(environ, name: str) -> Path | None:
    value = environ.get(name)
    return Path(value) if value else None


if __name__ == "__main__":
    raise SystemExit(main())
