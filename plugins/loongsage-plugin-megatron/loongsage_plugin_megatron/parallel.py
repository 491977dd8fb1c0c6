"""Parallel state of the megatron train backend: its options, its layout, its process groups.

``[train] backend_args`` (:class:`BackendOptions`):

* ``tp``: tensor-parallel size (default 1); ``pp``: pipeline-parallel size (default 1; the
  model's layers must split evenly over the stages);
* ``dp``: data-parallel size (default ``world_size // (tp * pp)``; ``tp * pp * dp`` must equal
  the number of ranks);
* ``dist_backend``: ``"auto"`` (NCCL on CUDA, Gloo on CPU), ``"gloo"`` or ``"nccl"``;
* ``use_distributed_optimizer``: shard the optimizer state over the data-parallel group with
  Megatron-Core's ``DistributedOptimizer`` (default false; needs CUDA, a clear error otherwise);
* ``ep``: expert-parallel size (default 1; MoE models only; must divide ``dp`` and the number
  of experts);
* ``sequence_parallel``: Megatron-Core's sequence parallelism (the activations outside the
  tensor-parallel matmuls split along the sequence over the tensor-parallel ranks); needs
  ``tp > 1``. Default (:func:`sequence_parallel`): on for a MoE model under ``tp > 1`` (Megatron-Core's
  MoE layers train under tensor parallelism only with it, so a MoE model with ``tp > 1`` and
  ``sequence_parallel = false`` is refused), off otherwise (a dense model keeps whole sequences
  per rank unless asked);
* ``moe_aux_loss_coeff``: weight of the MoE load-balancing loss (default 0: off).

:func:`parallel_sizes` and :func:`check_layout` turn them and the model's ``config.json`` into
the ``(tp, pp, dp, ep)`` layout or a ValueError naming the key at fault; :func:`init_parallel`
joins the process group (the host's rendezvous address and port, or a file rendezvous for a
world of one) and Megatron-Core's parallel state; the other helpers read that state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from loongsage_core.backend_api import structure_args

from . import cpu_compat

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from loongsage_hookspecs import Batch


@attrs.define(frozen=True)
class BackendOptions:
    """The validated ``[train] backend_args`` of the megatron backend (see the module docstring)."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    dist_backend: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "gloo", "nccl")))
    use_distributed_optimizer: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    ep: int = 1
    sequence_parallel: bool | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    moe_aux_loss_coeff: float = attrs.field(default=0.0, converter=float, validator=attrs.validators.ge(0.0))

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "BackendOptions":
        return structure_args(cls, args, "[train] backend_args", "megatron backend")


def parallel_sizes(options: BackendOptions, world_size: int,
                   num_experts: int | None = None) -> tuple[int, int, int, int]:
    """``(tp, pp, dp, ep)`` for ``world_size`` ranks; raises ValueError naming the bad backend_args.

    ``num_experts`` is the model's number of routed experts (None for a dense model). Megatron-Core
    forms each expert-parallel group from data-parallel ranks (of one tensor-parallel slice), so
    ``ep`` must divide ``dp``; it must also divide the number of experts (each rank holds an equal
    share of every MoE layer's experts).
    """
    tp, pp, ep = int(options.tp), int(options.pp), int(options.ep)
    if tp < 1 or pp < 1:
        raise ValueError(f"[train] backend_args: tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if world_size % (tp * pp):
        raise ValueError(f"[train] backend_args: {world_size} ranks are not divisible by tp * pp = {tp * pp}")
    dp = world_size // (tp * pp) if options.dp is None else int(options.dp)
    if tp * pp * dp != world_size:
        raise ValueError(f"[train] backend_args: tp * pp * dp = {tp}*{pp}*{dp} != {world_size} ranks")
    if ep < 1:
        raise ValueError(f"[train] backend_args.ep must be >= 1, got {ep}")
    if ep > 1 and not num_experts:
        raise ValueError(f"[train] backend_args.ep = {ep}: expert parallelism needs a Mixture-of-Experts model, "
                         "but the model in [model] path is dense (its config.json names no experts); set ep = 1")
    if dp % ep:
        raise ValueError(f"[train] backend_args.ep = {ep} must divide the data-parallel size dp = {dp} "
                         "(Megatron-Core forms expert-parallel groups from data-parallel ranks)")
    if num_experts and num_experts % ep:
        raise ValueError(f"[train] backend_args.ep = {ep} must divide the model's {num_experts} experts "
                         "(every expert-parallel rank holds an equal share)")
    return tp, pp, dp, ep


def sequence_parallel(options: BackendOptions, tp: int, num_experts: int | None) -> bool:
    """Whether the model runs Megatron-Core's sequence parallelism: ``backend_args.sequence_parallel``,
    by default on exactly for a Mixture-of-Experts model under ``tp > 1``; ValueError when it is
    asked for with ``tp = 1`` (there is no tensor-parallel group to split the sequence over)."""
    if options.sequence_parallel is None:
        return bool(num_experts) and tp > 1
    if options.sequence_parallel and tp == 1:
        raise ValueError("[train] backend_args.sequence_parallel = true needs tp > 1 (it splits the sequence "
                         "over the tensor-parallel ranks), but tp = 1; set sequence_parallel = false or "
                         "leave it out")
    return bool(options.sequence_parallel)


def check_layout(options: BackendOptions, role: str, tp: int, pp: int, hf_config: dict[str, Any],
                 num_experts: int | None, *, cuda: bool) -> None:
    """Raise ValueError naming the backend_args key that this model cannot run with, or that the
    trainer's devices cannot (``cuda``: whether the ranks have CUDA devices; ``loongsage validate``
    reads it from ``[placement] trainer_gpus``, a worker from its own machine)."""
    sp = sequence_parallel(options, tp, num_experts)
    if role == "actor" and options.use_distributed_optimizer:
        blocker = cpu_compat.distributed_optimizer_blocker(cuda)
        if blocker:
            raise ValueError(f"[train] backend_args.use_distributed_optimizer = true cannot run here: {blocker}; "
                             "set it to false (the optimizer state is then replicated on each rank)")
    layers = hf_config.get("num_hidden_layers")
    if isinstance(layers, int) and layers % pp:
        raise ValueError(f"[train] backend_args.pp = {pp}: the model's {layers} layers do not split evenly "
                         "over the pipeline stages")
    if num_experts and tp > 1 and not sp:
        # Megatron-Core's MoELayer refuses to train under tensor parallelism without sequence
        # parallelism (MoELayer.forward raises).
        raise ValueError(f"[train] backend_args.tp = {tp} with sequence_parallel = false: Mixture-of-Experts "
                         "models need sequence parallelism under tensor parallelism (Megatron-Core's MoE "
                         "layers train with tp > 1 only with it); set sequence_parallel = true (the default "
                         "for MoE models) or tp = 1")
    if options.moe_aux_loss_coeff and not num_experts:
        raise ValueError(f"[train] backend_args.moe_aux_loss_coeff = {options.moe_aux_loss_coeff}: the model "
                         "in [model] path is dense (no MoE load-balancing loss)")


def read_hf_config(config_file: Path) -> dict[str, Any]:
    """A Hugging Face ``config.json`` as a dict (ValueError naming the file if it is not a JSON table)."""
    import json

    try:
        value = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"[model] path: '{config_file}' is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"[model] path: '{config_file}' does not hold a JSON table")
    return value


# The Hugging Face config keys Megatron-Bridge reads as the number of routed experts (``num_moe_experts``).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def hf_num_experts(config: dict[str, Any]) -> int | None:
    """The number of routed experts of a Hugging Face config, None for a dense model."""
    for key in _EXPERT_COUNT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def init_parallel(options: BackendOptions, ctx: Any, rank: int, world_size: int,
                  tp: int, pp: int, ep: int) -> None:
    """Join the process group (unless this process has one) and Megatron-Core's parallel state.

    ``ctx`` gives the rendezvous (``master_addr``, ``master_port``; ``MASTER_PORT`` otherwise);
    one rank without a port rendezvouses through a fresh file. A parallel state of the same
    sizes is kept (a second model of this process, the reference, shares it); one of other
    sizes is replaced.
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
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size)
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size())
        if current == (tp, pp, ep):  # a second model of this process (the reference) shares it
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)


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
