"""The ``[train] backend_args`` of the torch train backend, and the device they name.

Kept apart from the worker so that the options, their defaults and their validation read in one
place (the worker, the critic and the README point here).

``[train] backend_args`` of this backend:

* ``device``: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``;
* ``master_weights``: ``"float32"`` (default: parameters and optimizer in float32, the decoder runs
  under autocast in ``[model] dtype``) or ``"model"`` (parameters stored in ``[model] dtype``);
* ``forward_micro_batch_size``: rows per chunk of the worker's ``forward`` (default ``micro_batch_size``);
* ``dist_backend``: ``"auto"`` (NCCL on CUDA, Gloo on CPU), ``"gloo"`` or ``"nccl"``;
* ``grad_sync_bucket_mb``: size of the flat gradient buckets all-reduced across ranks (64);
* ``rollback_overflow``: take back an optimizer step whose update made a weight non-finite
  (default ``true``: the parameters and optimizer state are copied before each step that might
  overflow, see :mod:`.rollback`); ``false`` skips the check and the copy, and such a step ends
  the run;
* ``share_prompts``: rows of a micro-batch that begin with the same prompt (a GRPO group) run it
  once, each completion attending to the one copy (default ``true``, see
  :func:`.packing.prompt_groups`); the same log-probs, loss and gradients within float32
  tolerance, fewer tokens through the model. Used for scored tokens (a ``loss_mask``) on the
  SDPA and eager attention paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from loongsage_core.backend_api.schema import structure_args

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


@attrs.define(frozen=True)
class BackendOptions:
    """The validated ``[train] backend_args`` of the torch backend (see the module docstring)."""

    device: str = attrs.field(default="auto", validator=attrs.validators.instance_of(str))
    master_weights: str = attrs.field(default="float32", validator=attrs.validators.in_(("float32", "model")))
    forward_micro_batch_size: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    dist_backend: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "gloo", "nccl")))
    grad_sync_bucket_mb: float = attrs.field(default=64.0, converter=float, validator=attrs.validators.gt(0.0))
    rollback_overflow: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    share_prompts: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "BackendOptions":
        return structure_args(cls, args, "[train] backend_args", "torch backend")


def check_job(job: Any) -> None:
    """The torch backend's checks of a job at validation (``TrainBackendSpec.check_job``): its
    ``backend_args`` keys and values, and the device they ask for against the GPUs each trainer
    rank reserves (``[placement] trainer_gpus``; a rank without one sees no CUDA device)."""
    options = BackendOptions.from_args(dict(job.train.backend_args))
    gpus = float(job.placement.trainer_gpus)
    if options.device != "auto":
        try:
            kind = _device_type(options.device)
        except RuntimeError as exc:
            raise ValueError(f"[train] backend_args.device = {options.device!r} is not a torch device "
                             f"({exc})") from None
        if kind == "cuda" and gpus <= 0:
            raise ValueError(f"[train] backend_args.device = {options.device!r}, but [placement] trainer_gpus = 0: "
                             "the trainer ranks reserve no GPU, so they see none; set trainer_gpus (e.g. 1) or "
                             "device = 'cpu'")
    if options.dist_backend == "nccl" and gpus <= 0 and job.train.num_workers > 1:
        raise ValueError("[train] backend_args.dist_backend = 'nccl' needs GPUs, but [placement] trainer_gpus = 0; "
                         "use 'gloo' or 'auto'")


def _device_type(name: str) -> str:
    """The device type of a torch device string (``cuda:1`` -> ``cuda``), parsed as torch parses it."""
    import torch

    return torch.device(name).type


def resolve_device(name: str) -> "torch.device":
    """The torch device for ``backend_args.device`` (``auto`` picks the current CUDA device if any)."""
    import torch

    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"[train] backend_args.device = {name!r} but CUDA is not available")
    return device
