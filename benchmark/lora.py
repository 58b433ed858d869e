"""What serving LoRA adapters costs: `bench lora` runs the same requests through the offline
engine on the base model alone, then with 32 clients' requests spread over 1, 4, ... adapters
of each rank (every request names one), and reports req/s, output tokens/s, inter-token latency
and the ratio to the base model. The adapters are random, in PEFT's format, made for the
model's shapes (q/k/v/o/gate/up/down of every layer), so any model folder works. Figures, not
tests."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from benchmark.tables import write_report

logger = logging.getLogger(__name__)

BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT's default target modules for Llama-family models (what most published adapters use)
PEFT_DEFAULT = "q_proj,v_proj"


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="req/s and inter-token latency with requests spread over "
                       "LoRA adapters, against the base model alone, offline")
    p.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    p.add_argument("--adapters", default="1,4,16", help="adapter counts, comma-separated")
    p.add_argument("--ranks", default="8,16,64", help="adapter ranks, comma-separated")
    p.add_argument("--targets", default=PEFT_DEFAULT, help="modules each adapter updates, "
                   "comma-separated, or 'all' (the 7 projections); default: PEFT's for Llama")
    p.add_argument("--clients", type=int, default=32, help="requests running at once")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, help="write lora.json and lora.md here")


def run(args: argparse.Namespace) -> int:
    from handler.model_source.default_model import ensure_default_model

    model_dir = args.model_dir or ensure_default_model()
    counts = [int(c) for c in args.adapters.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    targets = tuple(BLOCKS) if args.targets == "all" else tuple(args.targets.split(","))
    unknown = [t for t in targets if t not in BLOCKS]
    if unknown:
        raise ValueError(f"--targets: unknown module {unknown[0]} (one of {', '.join(BLOCKS)})")
    results: dict = {"model": model_dir.name, "clients": args.clients, "targets": targets,
                     "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                     "new_tokens": args.new_tokens, "runs": []}
    base = measure(args, model_dir, 0, 0, None)
    results["runs"].append(base)
    with tempfile.TemporaryDirectory(prefix="batchyard-lora-") as folder:
        for rank in ranks:
            for count in counts:
                adapters = [write_adapter(Path(folder) / f"r{rank}-{i}", model_dir, rank, i,
                                          targets) for i in range(count)]
                run = measure(args, model_dir, count, rank, adapters)
                run["ratio_to_base"] = round(run["requests_per_s"] / base["requests_per_s"], 3)
                results["runs"].append(run)
    report(results, args.out)
    return 0


def write_adapter(folder: Path, model_dir: Path, rank: int, seed: int,
                  targets: tuple[str, ...] = tuple(BLOCKS)) -> Path:
    """A random PEFT adapter of `rank` on every layer's `targets` projections."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            out, inp = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{BLOCKS[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator)
            tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(out, rank, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(targets)}))
    return folder


def measure(args: argparse.Namespace, model_dir: Path, count: int, rank: int,
            adapters: list[Path] | None) -> dict:
    """Every request queued at once, at most `clients` running; request i names adapter
    i % count. Inter-token latency: the step times each running sequence waited."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    lora = adapters is not None
    config = EngineConfig(
        model=str(model_dir), batching="paged", max_num_seqs=args.clients,
        max_model_len=args.prompt_tokens + args.new_tokens + 16, device=args.device,
        dtype=args.dtype, enable_lora=lora, max_loras=max(1, count),
        max_lora_rank=max(rank, 1) if lora else 16,
        lora_modules=tuple((p.name, str(p)) for p in adapters or ()))
    engine = LLMEngine.from_config(config)
    names = [p.name for p in adapters or ()]
    for i in range(args.requests):
        prompt = [3 + (i * 7 + j) % 200 for j in range(args.prompt_tokens)]
        params = SamplingParams(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                ignore_eos=True, adapter=names[i % count] if names else None)
        engine.add_request(str(i), prompt, params)
    gaps: list[float] = []
    started = last = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        produced = sum(event.token_id is not None for event in engine.step())
        now = time.perf_counter()
        gaps += [now - last] * produced
        tokens, last = tokens + produced, now
    seconds = time.perf_counter() - started
    engine.close()
    gaps.sort()
    return {"adapters": count, "rank": rank, "requests_per_s": round(args.requests / seconds, 3),
            "output_tokens_per_s": round(tokens / seconds, 1),
            "itl_p50_ms": round(1000 * statistics.median(gaps), 2),
            "itl_p99_ms": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 2)}


def table(results: dict) -> str:
    lines = ["| adapters | rank | req/s | output tok/s | inter-token p50 / p99 (ms) | "
             "vs base |", "|---|---|---|---|---|---|"]
    for run in results["runs"]:
        name = "base model" if run["adapters"] == 0 else str(run["adapters"])
        rank = str(run["rank"]) if run["rank"] else "–"
        ratio = f"{run['ratio_to_base']:.2f}x" if "ratio_to_base" in run else "1.00x"
        lines.append(f"| {name} | {rank} | {run['requests_per_s']:.3f} | "
                     f"{run['output_tokens_per_s']:.1f} | {run['itl_p50_ms']:.1f} / "
                     f"{run['itl_p99_ms']:.1f} | {ratio} |")
    return "\n".join(lines)


def report(results: dict, out: Path | None) -> None:
    caption = (f"`bench lora`: {results['model']}, adapters on {', '.join(results['targets'])}, "
               f"{results['clients']} clients, {results['requests']} requests of "
               f"{results['prompt_tokens']} + {results['new_tokens']} tokens, offline paged "
               "engine.")
    write_report(out, "lora", results, caption, table(results))
