"""Importing Triton for a device: compiled kernels on CUDA, Triton's interpreter on the CPU.

The same kernels run in both places, which is how CI (no GPU) proves the GPU kernels: on the
CPU, Triton's interpreter runs each program of a kernel in NumPy, slowly but exactly. Triton
decides at import whether it interprets (its `TRITON_INTERPRET` setting decorates its own
library functions then), so the choice is made once per process, before the first import:
a process that imported Triton compiled cannot interpret, nor the reverse.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch

INTERPRET = "TRITON_INTERPRET"  # Triton's own setting, read when it is imported


class TritonUnavailable(RuntimeError):
    """Triton cannot run kernels on this device in this process."""


def import_triton(device: torch.device) -> ModuleType:
    """The `triton` module, set up to run kernels on `device` (interpreted on the CPU).

    Raises TritonUnavailable when it is not installed, when the device is neither CUDA nor
    the CPU, or when an earlier import already fixed the other mode in this process."""
    if device.type not in ("cpu", "cuda"):
        raise TritonUnavailable(f"Triton kernels run on CUDA or (interpreted) on the CPU, not "
                                f"{device.type}")
    interpret = device.type == "cpu"
    if "triton" not in sys.modules and interpret:
        # NOTE: we set Triton's setting rather than read one of ours: it must hold before the
        # import below, and only Triton reads it.
        os.environ[INTERPRET] = "1"
    try:
        import triton
    except ImportError as err:
        raise TritonUnavailable("Triton is not installed (pip install triton)") from err
    if interpreting(triton) != interpret:
        mode = "interpreted" if interpreting(triton) else "compiled"
        wanted = "interpreted" if interpret else "compiled"
        raise TritonUnavailable(f"Triton was imported {mode} earlier in this process; kernels "
                                f"on {device.type} need it {wanted}")
    return triton


def interpreting(triton: ModuleType) -> bool:
    """Whether this process's Triton runs kernels through its interpreter."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # Triton >= 3.4
        return bool(knobs.runtime.interpret)
    return os.environ.get(INTERPRET, "0") not in ("", "0")
