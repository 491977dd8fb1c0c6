"""The megatron backend's data-parallel wrapper, optimizer, learning-rate schedule and step.

The actor's model chunks are wrapped in ``megatron.core.distributed.DistributedDataParallel``
(:func:`wrap_ddp`): gradients accumulate in its contiguous buffers and
``finalize_model_grads`` sums them over the data-parallel group (the host's loss is already
divided by the mini-batch's global norm, so they are summed, not averaged). The optimizer is
``megatron.core.optimizer.get_megatron_optimizer`` with Adam (decoupled weight decay on every
parameter, like the torch backend), which computes the gradient norm over the tensor- and
pipeline-parallel shards and clips to ``[train] grad_clip`` inside its ``step()``; under
``use_distributed_optimizer`` its state is sharded over the data-parallel group. The learning
rate follows the ``[train]`` schedule of the torch backend (:mod:`.schedule`: a ``LambdaLR`` on
the torch optimizer inside the Megatron one). A step whose gradients are not finite is skipped
(``train/skipped_step`` = 1), as in the torch backend (:func:`optimizer_step`).

An update that overflows the weights (finite gradients, a learning rate far too large) is
detected and reported (``train/nonfinite_weights``) but not rolled back: unlike the torch
backend this backend keeps no copy of the parameters and the (possibly sharded) optimizer state
before each step, so the host ends the run at once, before the weights reach the engines, and
the run resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

from .layout import BackendOptions


def wrap_ddp(modules: list[Any], options: BackendOptions) -> list[Any]:
    """Wrap each model chunk in Megatron-Core's ``DistributedDataParallel`` (grad buffers, DP reduction).

    The gradient buffers are float32 whatever the parameters' dtype (``grad_reduce_in_fp32``):
    under bfloat16 / float16 each micro-batch's 16-bit gradient is added into a float32 buffer,
    which is summed over the data-parallel group in float32 and handed to the optimizer's float32
    master weights as it is."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=options.use_distributed_optimizer, grad_reduce_in_fp32=True,
        overlap_grad_reduce=False, overlap_param_gather=False, average_in_collective=False)
    return [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m,
                                    disable_bucketing=index > 0)
            for index, m in enumerate(modules)]


INITIAL_LOSS_SCALE = 2.0 ** 16
"""float16's first dynamic loss scale (Megatron-Core's default, 2**32, would skip ~17 steps while it
backs off to a scale the 16-bit gradients hold; 2**16 is torch's ``GradScaler`` default)."""


def build_optimizer(chunks: list[Any], train: Any, options: BackendOptions,
                    dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Megatron-Core's Adam over the DDP ``chunks``, and the ``[train]`` learning-rate schedule.

    ``dtype`` is the parameters' (``[model] dtype``). float32: Megatron-Core's ``FP32Optimizer``.
    bfloat16 / float16: its mixed-precision optimizer (``Float16OptimizerWithFloat16Params``, or
    the ``DistributedOptimizer`` under ``use_distributed_optimizer``), which keeps a float32 master
    copy of every 16-bit parameter, steps Adam on the master weights with the float32 gradients
    and copies them back rounded to the 16-bit parameters. float16 adds Megatron-Core's
    ``DynamicGradScaler`` (first scale :data:`INITIAL_LOSS_SCALE`, halved after 2 overflowing
    steps in a row, doubled after 1000 clean ones); the schedule multiplies the loss by the scale
    before the backward pass (``config.grad_scale_func = optimizer.scale_loss``) and the optimizer
    unscales the gradients before clipping and stepping.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    from .schedule import make_megatron_scheduler

    if len(train.betas) != 2:
        raise ValueError(f"[train] betas must have two values, got {train.betas}")
    config = OptimizerConfig(
        optimizer="adam", lr=float(train.lr), min_lr=float(train.lr) * float(train.min_lr_ratio),
        weight_decay=float(train.weight_decay), adam_beta1=float(train.betas[0]),
        adam_beta2=float(train.betas[1]), adam_eps=float(train.eps), decoupled_weight_decay=True,
        clip_grad=float(train.grad_clip), fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16,
        params_dtype=dtype, initial_loss_scale=INITIAL_LOSS_SCALE,
        use_distributed_optimizer=options.use_distributed_optimizer)
    # No overrides: every parameter decays like in the torch backend (Megatron's default
    # groups would exempt biases and norms, relying on its own scheduler for ``wd_mult``).
    optimizer = get_megatron_optimizer(config, chunks, config_overrides={})
    if dtype != torch.float32:
        # what Megatron's training loop does: the schedules scale each loss before its backward
        for chunk in chunks:
            get_model_config(chunk).grad_scale_func = optimizer.scale_loss
    return optimizer, make_megatron_scheduler(optimizer, train)


def grad_buffers(chunks: list[Any]) -> list[Any]:
    """Megatron DDP's gradient buffers of ``chunks`` (dense and expert-parallel; none when not wrapped)."""
    from megatron.core.distributed import DistributedDataParallel

    return [buffer for chunk in chunks if isinstance(chunk, DistributedDataParallel)
            for buffer in chunk.buffers + chunk.expert_parallel_buffers]


def grads_finite(chunks: list[Any], device: torch.device) -> bool:
    """Whether every rank's reduced gradient buffers are finite (all ranks get the same answer)."""
    import torch.distributed as dist

    finite = all(bool(torch.isfinite(buffer.grad_data).all()) for buffer in grad_buffers(chunks))
    flag = torch.tensor([1.0 if finite else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def optimizer_step(optimizer: Any, scheduler: Any, chunks: list[Any], device: torch.device) -> dict[str, float]:
    """Megatron's ``step()``: gradient norm over model-parallel shards, clipping, Adam update.

    Not-finite gradients skip the update (the fp32 Megatron optimizer would apply it); the
    schedule advances either way so resumed and uninterrupted runs stay aligned. Returns
    ``train/grad_norm``, ``train/lr`` (the rate this step used), ``train/skipped_step`` and
    ``train/nonfinite_weights`` (tensors the update made non-finite: the host then ends the run).
    """
    lr = float(optimizer.param_groups[0]["lr"])
    overflowed = False
    if grads_finite(chunks, device):
        try:
            updated, grad_norm, _ = optimizer.step()
            if grad_norm is None:  # no clipping (``clip_grad`` 0): the norm was not computed
                grad_norm = optimizer.get_grad_norm()
            if not updated:  # the mixed-precision optimizer's own overflow check (already done above)
                grad_norm = float("nan")
        except RuntimeError as exc:  # a step size beyond float range: torch stops part-way through
            if "without overflow" not in str(exc):
                raise
            updated, grad_norm, overflowed = True, optimizer.get_grad_norm(), True
    else:
        optimizer.prepare_grads()  # under float16 also backs the loss scale off
        updated, grad_norm = False, optimizer.get_grad_norm()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    nonfinite = nonfinite_weights(chunks, device) if updated else 0
    if overflowed:
        nonfinite = max(1, nonfinite)
    return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped_step": 0.0 if updated else 1.0,
            "train/nonfinite_weights": float(nonfinite)}


def nonfinite_weights(chunks: list[Any], device: torch.device) -> int:
    """How many parameter tensors hold a non-finite value after the step (the most over all ranks,
    so every rank reports the same)."""
    import torch.distributed as dist

    count = sum(not bool(torch.isfinite(p).all()) for chunk in chunks for p in chunk.parameters())
    flag = torch.tensor([float(count)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers a (possibly chained) Megatron optimizer steps."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


@contextlib.contextmanager
def step_hyperparameters(optimizer: Any, hyperparameters: Mapping[str, float] | None) -> Iterator[None]:
    """Steps inside use ``hyperparameters`` (any of ``STEP_HYPERPARAMETERS``, ``backend_api.training``).

    ``lr``, ``beta1``, ``beta2``, ``eps`` and ``weight_decay`` are set on every parameter group
    of the torch Adam inside Megatron's optimizer and stay (the learning-rate schedule sets ``lr``
    again after the step); ``grad_clip`` replaces ``clip_grad`` of Megatron's optimizer config
    (which its ``step()`` clips to) for the steps inside only, ``0`` meaning no clipping.
    """
    from loongsage_core.backend_api.training import apply_step_hyperparameters

    given = apply_step_hyperparameters(optimizer.param_groups, hyperparameters,
                                       where="MegatronTrainWorker.optimizer_step")
    configs = {id(inner.config): inner.config for inner in _inner_optimizers(optimizer)}.values()
    saved = [(config, config.clip_grad) for config in configs]
    if "grad_clip" in given:
        for config in configs:
            config.clip_grad = max(0.0, float(given["grad_clip"]))
    try:
        yield
    finally:
        for config, clip in saved:
            config.clip_grad = clip


ADAM_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
"""The per-parameter Adam state :func:`reset_adam_state` zeroes."""


def reset_adam_state(optimizer: Any) -> None:
    """Zero Adam's moments and step counts in place: the next step is the first of a fresh Adam.

    In place rather than dropped, so the state keeps the layout Megatron's optimizers (and their
    checkpoints, sharded ones included) expect; zero moments and step count are exactly the state
    Adam starts from. The float32 master weights of 16-bit parameters are kept.
    """
    for inner in _inner_optimizers(optimizer):
        torch_optimizer = inner.optimizer
        for state in torch_optimizer.state.values():
            for key in ADAM_STATE:
                value = state.get(key)
                if torch.is_tensor(value):
                    value.zero_()
                elif value is not None:
                    state[key] = 0
        for group in torch_optimizer.param_groups:
            if "step" in group:  # optimizers that count steps per group (fused Adam)
                group["step"] = 0
