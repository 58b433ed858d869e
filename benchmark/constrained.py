"""What structured output costs: `bench grammar-masks` times one allowed-token mask per token
(llguidance, and xgrammar when it is installed, on the same tokenizer, schemas and answers);
`bench constrained` runs the offline engine at a fixed batch over the 20 schemas of
benchmark/schemas.py, then replays the very same requests (same prompts, same answer lengths)
without a grammar, and reports output tokens/s of both. Figures, not tests."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from benchmark.schemas import SCHEMAS

logger = logging.getLogger(__name__)
PROMPT = "Reply with JSON only."


def add_parsers(sub) -> None:
    masks = sub.add_parser("grammar-masks", help="per-token mask cost of llguidance (and "
                           "xgrammar when installed) on the 20 schemas")
    masks.add_argument("--model-dir", type=Path, help="tokenizer (default: the embedded model)")
    masks.add_argument("--repeat", type=int, default=5, help="passes over each answer")
    masks.add_argument("--out", type=Path, help="write grammar-masks.json here")
    run = sub.add_parser("constrained", help="engine throughput with and without JSON schemas")
    run.add_argument("--model-dir", type=Path, help="default: the embedded default model")
    run.add_argument("--batch", type=int, default=32, help="sequences in flight")
    run.add_argument("--requests", type=int, default=96)
    run.add_argument("--strategy", choices=("continuous", "paged"), default="paged")
    run.add_argument("--out", type=Path, help="write constrained.json here")


def grammar_masks(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from handler.model_source.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir or ensure_default_model(),
                                              local_files_only=True)
    answers = [tokenizer.encode(json.dumps(instance), add_special_tokens=False)
               for _, instance in SCHEMAS]
    results = {"tokenizer_vocab": len(tokenizer), "llguidance": _time_llguidance(
        tokenizer, answers, args.repeat)}
    try:
        results["xgrammar"] = _time_xgrammar(tokenizer, answers, args.repeat)
    except ImportError:
        logger.info("xgrammar is not installed: llguidance only")
    write_report(results, args.out, "grammar-masks.json")
    return 0


def _time_llguidance(tokenizer, answers: list[list[int]], repeat: int) -> dict:
    import llguidance
    import llguidance.hf
    import numpy as np

    from engine.guided import GuidedSpec, grammar_text

    llg = llguidance.hf.from_tokenizer(tokenizer)
    mask = np.zeros((llg.vocab_size + 31) // 32, dtype=np.int32)
    compile_s, per_token = [], []
    for (schema, _), answer in zip(SCHEMAS, answers, strict=True):
        start = time.perf_counter()
        compiled = llguidance.LLMatcher(llg, grammar_text(GuidedSpec.json_schema(schema)))
        compile_s.append(time.perf_counter() - start)
        for _ in range(repeat):
            matcher = compiled.deep_copy()
            for token in answer:
                start = time.perf_counter()
                matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
                per_token.append(time.perf_counter() - start)
                assert matcher.consume_token(token), matcher.get_error()
    return _summary(compile_s, per_token)


def _time_xgrammar(tokenizer, answers: list[list[int]], repeat: int) -> dict:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    compile_s, per_token = [], []
    for (schema, _), answer in zip(SCHEMAS, answers, strict=True):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(", ", ": "))
        compile_s.append(time.perf_counter() - start)
        for _ in range(repeat):
            matcher = xgrammar.GrammarMatcher(compiled)
            for token in answer:
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(mask)
                per_token.append(time.perf_counter() - start)
                assert matcher.accept_token(token)
    return _summary(compile_s, per_token)


def _summary(compile_s: list[float], per_token: list[float]) -> dict:
    per_token.sort()
    return {"compile_ms_mean": round(statistics.mean(compile_s) * 1e3, 2),
            "compile_ms_max": round(max(compile_s) * 1e3, 2),
            "mask_us_mean": round(statistics.mean(per_token) * 1e6, 1),
            "mask_us_p50": round(per_token[len(per_token) // 2] * 1e6, 1),
            "mask_us_p99": round(per_token[int(len(per_token) * 0.99)] * 1e6, 1),
            "tokens": len(per_token)}


def constrained(args: argparse.Namespace) -> int:
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.guided import GuidedSpec
    from handler.model_source.default_model import ensure_default_model

    config = EngineConfig(model=str(args.model_dir or ensure_default_model()),
                          batching=args.strategy, max_num_seqs=args.batch, max_model_len=512,
                          dtype="float32")
    engine = LLMEngine.from_config(config)
    prompt = engine.tokenizer.encode(PROMPT)
    guided = [SamplingParams(max_new_tokens=128, guided=GuidedSpec.json_schema(s))
              for s, _ in SCHEMAS]
    asked = [guided[i % len(guided)] for i in range(args.requests)]
    run_full_batch(engine, prompt, asked[:args.batch])  # warm-up: grammars compile, kernels load
    with_grammar, lengths = run_full_batch(engine, prompt, asked)
    free = [SamplingParams(max_new_tokens=n, min_new_tokens=n, ignore_eos=True)
            for n in lengths]
    without, _ = run_full_batch(engine, prompt, free)
    results = {"batch": args.batch, "requests": args.requests, "strategy": args.strategy,
               "output_tokens": sum(lengths),
               "guided_tokens_per_s": round(sum(lengths) / with_grammar, 1),
               "free_tokens_per_s": round(sum(lengths) / without, 1),
               "ratio": round(without / with_grammar, 3)}
    write_report(results, args.out, "constrained.json")
    return 0


def run_full_batch(engine, prompt: list[int], asked: list) -> tuple[float, list[int]]:
    """Keep the batch full: a finished request is replaced at once. Returns (seconds, output
    tokens of each request in order)."""
    lengths = [0] * len(asked)
    queue = list(enumerate(asked))
    start = time.perf_counter()
    in_flight = 0
    while queue or engine.has_unfinished():
        while queue and in_flight < engine.config.max_num_seqs:
            i, params = queue.pop(0)
            engine.add_request(str(i), prompt, params)
            in_flight += 1
        for event in engine.step():
            if event.finished:
                lengths[int(event.request_id)] = event.num_output_tokens
                in_flight -= 1
    return time.perf_counter() - start, lengths


def write_report(results: dict, out: Path | None, name: str) -> None:
    text = json.dumps(results, indent=2)
    logger.info("%s", text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text + "\n")
