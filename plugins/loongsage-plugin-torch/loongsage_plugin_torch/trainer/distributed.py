"""Data parallelism over ``torch.distributed``: process group setup and gradient summation.

The loss of every rank is already its share of the mini-batch loss (each micro-batch loss is
divided by the mini-batch's global norm), so the gradient of the mini-batch loss is the SUM of the
ranks' gradients, not their mean.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Iterable

from loongsage_core.backend_api.distributed import pin_gloo_to_this_node

if TYPE_CHECKING:  # pragma: no cover
    import torch


def init_process_group(*, rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
                       timeout_s: float = 600.0) -> None:
    """Join (or reuse) the default process group of ``world_size`` ranks at ``master_addr:master_port``."""
    import torch.distributed as dist

    if not 0 <= rank < world_size:
        raise ValueError(f"train worker rank {rank} is outside world size {world_size}")
    if master_port <= 0:
        raise ValueError(f"train worker rank {rank}: world_size {world_size} needs a master_port, got {master_port}")
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, but this worker is rank {rank} of {world_size}")
        return
    pin_gloo_to_this_node()  # its Gloo listeners on the node's address (loopback on one node), not every interface
    dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_parameters(tensors: Iterable["torch.Tensor"], src: int = 0) -> None:
    """Copy rank ``src``'s values of ``tensors`` to every rank (identical start despite any drift)."""
    import torch.distributed as dist

    for t in tensors:
        dist.broadcast(t.data, src=src)


def sum_gradients(params: Iterable["torch.Tensor"], bucket_bytes: int = 64 << 20) -> None:
    """All-reduce (SUM) the gradients of ``params`` in flat buckets per dtype and device.

    Parameters without a gradient (unused this step) get a zero gradient first, so every rank
    reduces the same buckets.
    """
    import torch
    import torch.distributed as dist

    groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= bucket_bytes:
                _reduce_bucket(bucket, dist)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, dist)


def _reduce_bucket(bucket: list["torch.Tensor"], dist: Any) -> None:
    import torch

    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in bucket:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def barrier() -> None:
    import torch.distributed as dist

    if is_distributed():
        dist.barrier()
