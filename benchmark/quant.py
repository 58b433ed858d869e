"""What quantized weights save and cost: `bench quant` serves one model folder as float (its
dtype), int8 and fp8 (option.quantize: weights quantized at load) and int4 (a W4A16
compressed-tensors `pack-quantized` checkpoint the bench writes itself by round-to-nearest,
lm_head and embeddings kept float), all on the same KV pool (a fixed num_kv_blocks), and
reports per variant: the bytes of the decoder's linear weights on the device (and of every
weight), their ratio to the float model's and to the same layers in bfloat16, decode tokens/s
at batch 1 and batch 32, and req/s with --clients requests running at once, all on the
offline engine (continuous batching, greedy). A variant that fails to start is reported with
its error. Figures, not tests."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from benchmark.tables import write_report

logger = logging.getLogger(__name__)

VARIANTS = ("float", "int8", "int4", "fp8")
DECODE_BATCHES = (1, 32)
GROUP_SIZES = (128, 64, 32)  # the first that divides every quantized layer's input width
BLOCK_SIZE = 16


def add_parser(sub) -> None:
    p = sub.add_parser("quant", help="weight memory, decode tokens/s and req/s of float, int8, "
                       "fp8 and int4 (W4A16) weights on one KV budget, offline")
    p.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    # small defaults: on the CPU, int4 and fp8 layers dequantize their weights at every step
    p.add_argument("--clients", type=int, default=16, help="requests running at once")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, help="the KV pool of every variant (default: "
                   "enough blocks for the largest batch's sequences at full length)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, help="write quant.json and quant.md here")


def run(args: argparse.Namespace) -> int:
    from handler.model_source.default_model import ensure_default_model

    model_dir = args.model_dir or ensure_default_model()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown variant {unknown[0]} (one of "
                         f"{', '.join(VARIANTS)})")
    seqs = max(*DECODE_BATCHES, args.clients)
    max_model_len = args.prompt_tokens + args.new_tokens + 16
    blocks = args.num_kv_blocks or seqs * -(-max_model_len // BLOCK_SIZE)
    results: dict = {"model": model_dir.name, "engine": "offline, continuous batching",
                     "device": args.device, "dtype": args.dtype, "num_kv_blocks": blocks,
                     "clients": args.clients, "requests": args.requests,
                     "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                     "bf16_linear_bytes": bf16_linear_bytes(model_dir), "runs": []}
    with tempfile.TemporaryDirectory(prefix="batchyard-quant-") as folder:
        for variant in variants:
            source, quantize = model_dir, None
            try:
                if variant == "int4":
                    source = write_w4a16(model_dir, Path(folder) / "int4")
                    results["int4_group_size"] = json.loads(
                        (source / "config.json").read_text())["quantization_config"][
                        "config_groups"]["group_0"]["weights"]["group_size"]
                elif variant != "float":
                    quantize = variant
                row = measure(args, source, quantize, blocks, seqs, max_model_len)
            except Exception as err:  # noqa: BLE001 - a variant that cannot start is a finding
                logger.warning("variant %s failed: %s", variant, err)
                row = {"error": f"{type(err).__name__}: {err}"}
            results["runs"].append({"variant": variant, **row})
    ratios(results)
    report(results, args.out)
    return 0


def quantized_names(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """The checkpoint's decoder linear weights (2-D `.weight` tensors inside `.layers.`),
    name → shape; embeddings, lm_head and norms stay float."""
    from engine.model_files import open_checkpoint
    from engine.models.loader import checkpoint_files

    shapes = {}
    for file in checkpoint_files(model_dir):
        with open_checkpoint(file) as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                if name.endswith(".weight") and ".layers." in name and len(shape) == 2:
                    shapes[name] = shape
    return shapes


def bf16_linear_bytes(model_dir: Path) -> int:
    """The decoder's linear weights in bfloat16: the int4 target's reference."""
    return sum(2 * n * k for n, k in quantized_names(model_dir).values())


def group_size(widths: set[int]) -> int:
    """128 where it divides every input width, else 64, else 32."""
    for group in GROUP_SIZES:
        if all(k % group == 0 for k in widths):
            return group
    raise ValueError(f"no group size of {GROUP_SIZES} divides every linear input width "
                     f"{sorted(widths)}")


def quantize_w4a16(weight, group: int) -> dict:
    """Symmetric int4 RTN of [N, K] `weight` in compressed-tensors' pack-quantized layout:
    weight_packed int32 [N, K/8] (k at bits 4 (k % 8) of word k // 8, stored q + 8),
    weight_scale [N, K/G] in the weight's dtype (max |w| / 7.5 per group), weight_shape."""
    import torch

    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    scale = (w.abs().amax(-1) / 7.5).to(weight.dtype)  # [N, K/G], rounded to its dtype first
    s = scale.float()[..., None]
    q = torch.where(s > 0, w / torch.where(s > 0, s, 1.0), 0.0).round().clamp(-8, 7)
    codes = (q.to(torch.int16) + 8).to(torch.uint8).view(n, k)  # [N, K] in 0..15
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous().view(torch.int32)
    return {"weight_packed": packed, "weight_scale": scale.contiguous(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def write_w4a16(model_dir: Path, out: Path) -> Path:
    """`model_dir` as a compressed-tensors W4A16 checkpoint in `out`: every decoder linear
    weight quantized by RTN (quantize_w4a16), the rest copied as it is, with its config,
    tokenizer and generation files."""
    from safetensors.torch import save_file

    from engine.model_files import open_checkpoint
    from engine.models.loader import checkpoint_files

    shapes = quantized_names(model_dir)
    if not shapes:
        raise ValueError(f"{model_dir}: no decoder linear weights to quantize")
    group = group_size({k for _, k in shapes.values()})
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in checkpoint_files(model_dir):
        with open_checkpoint(file) as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name in shapes:
                    prefix = name.removesuffix(".weight")
                    for suffix, t in quantize_w4a16(tensor, group).items():
                        tensors[f"{prefix}.{suffix}"] = t
                else:
                    tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in model_dir.iterdir():  # config, tokenizer, chat template, generation config
        if (path.is_file() and not path.name.startswith(".") and path.suffix != ".safetensors"
                and path.name != "model.safetensors.index.json"):
            shutil.copy(path, out / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": group, "dynamic": False, "actorder": None}}}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def linear_bytes(model) -> int:
    """Bytes of the decoder's linear layers (any module with in/out_features but lm_head:
    nn.Linear, the packed CPU layers, Int8Linear, IntQuantLinear, Fp8Linear)."""
    from benchmark.profile import weight_bytes

    return sum(weight_bytes(module) for name, module in model.named_modules()
               if hasattr(module, "in_features") and hasattr(module, "out_features")
               and not name.endswith("lm_head"))


def measure(args: argparse.Namespace, model_dir: Path, quantize: str | None, blocks: int,
            seqs: int, max_model_len: int) -> dict:
    from benchmark.profile import weight_bytes
    from engine import EngineConfig, LLMEngine

    config = EngineConfig(
        model=str(model_dir), batching="continuous", max_num_seqs=seqs,
        max_model_len=max_model_len, device=args.device, dtype=args.dtype,
        num_kv_blocks=blocks, block_size=BLOCK_SIZE, quantize=quantize)
    started = time.perf_counter()
    engine = LLMEngine.from_config(config)
    try:
        engine.guided.wait_built()  # its background build would slow the first steps measured
        model = engine.runner.model
        layers = sorted({type(m).__name__ for name, m in model.named_modules()
                         if hasattr(m, "in_features") and not name.endswith("lm_head")})
        row: dict = {"model_dtype": str(engine.runner.kv_cache.dtype).removeprefix("torch."),
                     "device_type": engine.runner.device.type,
                     "start_s": round(time.perf_counter() - started, 1), "layers": layers,
                     "linear_bytes": linear_bytes(model), "weight_bytes": weight_bytes(model)}
        _generate(engine, args, 1, 2)  # warm-up
        for batch in DECODE_BATCHES:
            row[f"decode_b{batch}_tokens_per_s"] = round(decode_rate(engine, args, batch), 1)
            logger.info("%s: decode at batch %d, %.1f tokens/s", model_dir.name, batch,
                        row[f"decode_b{batch}_tokens_per_s"])
        row["requests_per_s"] = round(request_rate(engine, args), 3)
        logger.info("%s: %d clients, %.3f req/s", model_dir.name, args.clients,
                    row["requests_per_s"])
    finally:
        engine.close()
    return row


def _prompt(args: argparse.Namespace, i: int) -> list[int]:
    return [3 + (i * 7 + j) % 200 for j in range(args.prompt_tokens)]


def _params(new_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True)


def _generate(engine, args: argparse.Namespace, batch: int, new_tokens: int) -> None:
    for i in range(batch):
        engine.add_request(f"warm-{i}", _prompt(args, i), _params(new_tokens))
    while engine.has_unfinished():
        engine.step()


def decode_rate(engine, args: argparse.Namespace, batch: int) -> float:
    """`batch` requests added at once; tokens/s over the steps after every one of them has its
    first token (the prefill is not counted)."""
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", _prompt(args, i), _params(args.new_tokens))
    started: set[str] = set()
    since = None
    tokens = 0
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        if since is not None:
            tokens += sum(event.token_id is not None for event in events)
        started |= {event.request_id for event in events if event.token_id is not None}
        if since is None and len(started) == batch:
            since = now
        last = now
    if since is None or tokens == 0:
        raise RuntimeError(f"batch {batch}: no decode step measured (--new-tokens >= 2)")
    return tokens / (last - since)


def request_rate(engine, args: argparse.Namespace) -> float:
    """--requests requests, --clients of them running at once (a new one as each ends)."""
    queued = iter(range(args.requests))
    for i in queued:
        engine.add_request(f"r{i}", _prompt(args, i), _params(args.new_tokens))
        if i + 1 >= args.clients:
            break
    started = time.perf_counter()
    while engine.has_unfinished():
        for event in engine.step():
            if event.finish_reason is not None:
                i = next(queued, None)
                if i is not None:
                    engine.add_request(f"r{i}", _prompt(args, i), _params(args.new_tokens))
    return args.requests / (time.perf_counter() - started)


def ratios(results: dict) -> None:
    """Each variant's linear bytes over float's and over the same layers in bfloat16."""
    base = next((r for r in results["runs"] if r["variant"] == "float" and "error" not in r),
                None)
    for row in results["runs"]:
        if "error" in row:
            continue
        if base is not None:
            row["ratio_to_float"] = round(row["linear_bytes"] / base["linear_bytes"], 3)
        row["ratio_to_bf16"] = round(row["linear_bytes"] / results["bf16_linear_bytes"], 3)


def table(results: dict) -> str:
    mib = 2**20
    lines = ["| variant | linear weights (MiB) | all weights (MiB) | vs float | vs bf16 | "
             "decode tok/s b1 | decode tok/s b32 | req/s |", "|---|---|---|---|---|---|---|---|"]
    for row in results["runs"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | failed: {row['error'][:200]} | | | | | | |")
            continue
        name = row["variant"]
        if name == "float":
            name += f" ({row['model_dtype']})"
        vs_float = f"{row['ratio_to_float']:.2f}x" if "ratio_to_float" in row else "–"
        lines.append(f"| {name} | {row['linear_bytes'] / mib:.1f} | "
                     f"{row['weight_bytes'] / mib:.1f} | {vs_float} | "
                     f"{row['ratio_to_bf16']:.2f}x | {row['decode_b1_tokens_per_s']:.1f} | "
                     f"{row['decode_b32_tokens_per_s']:.1f} | {row['requests_per_s']:.3f} |")
    return "\n".join(lines)


def report(results: dict, out: Path | None) -> None:
    group = results.get("int4_group_size")
    caption = (
        f"`bench quant`: {results['model']}, offline engine (continuous batching), "
        f"{results['num_kv_blocks']} KV blocks for every variant, decode at batch "
        f"{' and '.join(map(str, DECODE_BATCHES))}, req/s with {results['clients']} "
        f"clients over {results['requests']} requests of {results['prompt_tokens']} + "
        f"{results['new_tokens']} tokens, greedy. Linear weights: the decoder's linear "
        f"layers (lm_head and embeddings are in all weights); vs bf16: over the same layers "
        f"in bfloat16 ({results['bf16_linear_bytes'] / 2**20:.1f} MiB)"
        + (f"; int4: compressed-tensors W4A16, RTN, group size {group}" if group else "") + ".")
    write_report(out, "quant", results, caption, table(results))
