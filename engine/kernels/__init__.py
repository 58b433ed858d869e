"""CPU kernels in plain C (paged_decode.c, fused_ops.c, greedy.c, gemm.c, lora.c), compiled once
per process and loaded with ctypes.

Why C: see each file's header. No library we can depend on has these for a paged pool on CPU
(vLLM's kernels ship only inside vLLM), so a few loops are compiled with the system C compiler
at start-up: no PyTorch headers, so the build takes about a second, and -march=native on the
machine that runs them. They run on PyTorch's own OpenMP runtime: torch has loaded libgomp.so.1
already, so the loader reuses it. Without a compiler, RuntimeError: callers fall back to PyTorch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
# -ffp-contract=off: no fused multiply-add where PyTorch rounds a product and a sum apart
# (gemm.c turns it back on for itself: a matmul's summation order is its own anyway).
# -fno-trapping-math: no FP exceptions are trapped here, so a float compare may become a vector
# select (the clamp in greedy.c's exp); it changes no result.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math",
         "-shared", "-fPIC"]
_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_DECODE = [_PTR] * 6 + [_I64] * 7  # pointers, then B, H, Hkv, D, page_size, max_pages, width
SIGNATURES = {
    "batchyard_decode_scores": [*_DECODE, _F32, _INT],
    "batchyard_decode_values": [*_DECODE, _INT],
    "batchyard_add_rms_norm": [_PTR] * 4 + [_I64, _I64, _F32, _INT],
    "batchyard_rope_store": [_PTR] * 7 + [_I64] * 4 + [_INT],
    "batchyard_greedy": [_PTR, _I64, _I64, _PTR, _INT],
    "batchyard_gemm_pack": [_PTR, _I64, _I64, _PTR],
    "batchyard_gemm": [_PTR] * 4 + [_I64] * 3 + [_INT],
    "batchyard_lora": [_PTR] * 6 + [_I64] * 4 + [_INT],
}


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load_kernels() -> ctypes.CDLL:
    """Compiles the C sources for this CPU and loads them; RuntimeError when it cannot."""
    lib = build_kernels()
    logger.info("CPU kernels built with %s", compiler())
    return lib


def build_kernels(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """A fresh build of the C sources with FLAGS + extra_flags (tests build for other CPUs)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH to build the CPU kernels")
    with tempfile.TemporaryDirectory(prefix="batchyard-kernels-") as tmp:
        library = Path(tmp) / "batchyard_kernels.so"
        command = [cc, *FLAGS, *extra_flags, *map(str, SOURCES), "-o", str(library)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"building the CPU kernels failed: {done.stderr[-500:]}")
        try:
            lib = ctypes.CDLL(str(library))  # stays mapped after the file is removed
        except OSError as err:  # e.g. a temporary folder mounted noexec
            raise RuntimeError(f"loading the CPU kernels failed: {err}") from err
    for name, argtypes in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, None
    return lib
