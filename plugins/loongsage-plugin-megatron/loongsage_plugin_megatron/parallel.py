"""The megatron train backend's process groups: joining them and Megatron-Core's parallel state
(:func:`init_parallel`, with the layout :mod:`.layout` checked), and the collectives and ranks
the worker reads from that state.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from loongsage_core.backend_api.distributed import pin_gloo_to_this_node

from . import cpu_compat

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from loongsage_hookspecs import Batch

    from .layout import BackendOptions


def init_parallel(options: BackendOptions, ctx: Any, rank: int, world_size: int,
                  tp: int, pp: int, ep: int) -> None:
    """Join the process group (unless this process has one) and Megatron-Core's parallel state.

    ``ctx`` gives the rendezvous (``master_addr``, ``master_port``; ``MASTER_PORT`` otherwise);
    one rank without a port rendezvouses through a fresh file. Megatron-Core's state gets the
    sizes ``tp``, ``pp``, ``ep`` and ``options``' virtual pipeline, context-parallel and expert
    tensor-parallel sizes. A parallel state of the same sizes is kept (a second model of this
    process, the reference, shares it); one of other sizes is replaced.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = options.dist_backend
        if backend == "auto":
            backend = "gloo" if cpu_compat.cuda_missing() else "nccl"
        port = int(ctx.master_port) or int(os.environ.get("MASTER_PORT", "0"))
        if world_size > 1 and not port:
            raise ValueError("megatron train backend: several ranks need ctx.master_port")
        init = f"tcp://{ctx.master_addr}:{port}" if port else f"file://{tmp_rendezvous()}"
        pin_gloo_to_this_node()  # Gloo's listeners on the node's address alone (loopback on one node)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size)
    if parallel_state.model_parallel_is_initialized():
        if _parallel_state_sizes() == (tp, pp, ep, options.virtual_stages, int(options.cp), options.expert_tp(tp)):
            return  # a second model of this process (the reference) shares it
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=options.virtual_stages,
                                             context_parallel_size=int(options.cp),
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=options.expert_tp(tp))


def _parallel_state_sizes() -> tuple[int, int, int, int | None, int, int]:
    """Megatron-Core's current ``(tp, pp, ep, vpp, cp, etp)`` (vpp None without virtual stages)."""
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size())


def close_parallel() -> None:
    """Leave Megatron-Core's parallel state and the process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank of the process group (a no-op without one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def tmp_rendezvous() -> str:
    """A fresh path for a file rendezvous (the file must not exist yet)."""
    import tempfile

    fd, name = tempfile.mkstemp(prefix="loongsage-megatron-")
    os.close(fd)
    os.unlink(name)
    return name


def tensor_parallel_rank() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_tensor_model_parallel_rank())


def data_parallel_rank() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_data_parallel_rank())


def model_parallel_rank() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_model_parallel_group().rank())


def broadcast_from_last_stage(tensor: "torch.Tensor") -> None:
    """Overwrite ``tensor`` on every pipeline stage with the last stage's (in place)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())


def sum_over_pipeline(values: "torch.Tensor") -> None:
    """Sum ``values`` over this rank's pipeline group (in place): each stage's share of a count."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())


def sum_over_tensor_parallel(values: "torch.Tensor") -> None:
    """Sum ``values`` over this rank's tensor-parallel group (in place): under sequence
    parallelism each rank's share of a per-token count."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.all_reduce(values, group=parallel_state.get_tensor_model_parallel_group())


def all_reduce_max_over_experts(values: "torch.Tensor") -> None:
    """Element-wise maximum of ``values`` over this rank's expert-parallel group (in place)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())


def sum_over_data_parallel(values: "torch.Tensor", dp: int) -> None:
    """Sum ``values`` over this rank's data-parallel group (in place; nothing to do when dp = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized() and dp > 1:
        dist.all_reduce(values, group=parallel_state.get_data_parallel_group())


def check_same_rows(batch: "Batch", caller: str, tp: int, pp: int, dp: int, device: "torch.device") -> None:
    """Raise ValueError unless every rank of this rank's model-parallel group (its TP x PP
    ranks) got the same rows: they run one model together (under PP > 1 different micro-batch
    counts would hang the pipeline schedule)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if tp * pp == 1:
        return
    ids = batch["input_ids"]
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.float64).view(ids.shape)
    mine = torch.tensor([float(ids.shape[0]), float(ids.shape[1]), float((ids.double() * weights).sum())],
                        dtype=torch.float64, device=device)
    group = parallel_state.get_model_parallel_group()
    seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(seen, mine, group=group)
    if any(not torch.equal(other, seen[0]) for other in seen):
        shapes = [f"{int(t[0])}x{int(t[1])}" for t in seen]
        raise ValueError(f"MegatronTrainWorker.{caller}: the {len(seen)} ranks of one model-parallel group "
                         f"(tp * pp = {tp}*{pp}) must receive the same rows (data parallelism "
                         f"splits rows over the {dp} data-parallel ranks only), but their input_ids "
                         f"differ (shapes by rank: {shapes})")
