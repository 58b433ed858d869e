"""KVLink: the disaggregated workers' point-to-point wire, torch.distributed over a TCP store.

gloo moves tensors through host memory (CPU workers, or GPU workers sharing a card), NCCL
between GPUs. Every worker joins one group at start-up (the store at kv_ip:kv_port, hosted by
rank 0); after that, transfers are plain send/recv between two ranks on a tag, ordered per
(sender, receiver, tag). Hosts other than this one can join the same store: the wire does not
care where a rank runs."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

JOIN_TIMEOUT = timedelta(minutes=10)  # every worker imports torch and joins before loading


class KVLink:
    """This worker's end: `rank` of `world_size`, tensors staged on `device`."""

    def __init__(self, rank: int, world_size: int, host: str, port: int,
                 device: torch.device, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                              timeout=JOIN_TIMEOUT, wait_for_workers=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=JOIN_TIMEOUT)
        # from now on a transfer that waits longer for its peer raises: the peer is gone
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
        logger.info("KV link: worker %d of %d joined %s:%d (%s)", rank, world_size, host, port,
                    backend)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        dist.send(tensor.contiguous(), dst, tag=tag)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Keep `tensor` until the result's wait() returns."""
        work = dist.isend(tensor, dst, tag=tag)
        assert work is not None  # a member of the group always gets one
        return work

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int,
             tag: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(tensor, src, tag=tag)
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
