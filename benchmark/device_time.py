"""Device-side time for `bench profile`: kernel time per step from torch.profiler, and the
device sync its phase clock waits with."""

from __future__ import annotations

from collections.abc import Callable


def device_busy(work: Callable[[], object], steps: int, top: int = 8
                ) -> tuple[float, tuple[tuple[str, float, float], ...]]:
    """Kernel time per step of `work` (which runs `steps` engine steps) on CUDA, from
    torch.profiler, without syncs inside the steps; and the `top` kernels by device time
    (name, µs per step, launches per step). Device events only: a host-side event's self
    device time repeats its kernels' (as torch's own table sums it; before 2026-11-26 this
    summed both, so it may have counted kernels twice)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    return kernel_time(prof.key_averages(), DeviceType.CUDA, steps, top)


def kernel_time(events, device_type, steps: int, top: int = 8
                ) -> tuple[float, tuple[tuple[str, float, float], ...]]:
    """(ms per step, top kernels) from profiler averages, counting `device_type` events only."""
    kernels = [e for e in events if e.device_type == device_type and e.self_device_time_total]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    listed = tuple((e.key[:120], e.self_device_time_total / steps, e.count / steps)
                   for e in kernels[:top])
    return sum(e.self_device_time_total for e in kernels) / 1000 / steps, listed


def device_sync(device) -> Callable[[], None] | None:
    """What waits for the device's queued work (None on CPU)."""
    if device.type != "cuda":
        return None  # CPU ops finish before they return: nothing to wait for
    import torch

    return torch.cuda.synchronize
