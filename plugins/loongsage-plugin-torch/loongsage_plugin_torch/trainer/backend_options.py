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
  (default ``true``: the parameters and optimizer state are copied before each step, see
  :mod:`.rollback`); ``false`` saves that copy, and such a step ends the run;
* ``share_prompts``: rows of a micro-batch that begin with the same prompt (a GRPO group) run it
  once, each completion attending to the one copy (default ``true``, see
  :func:`.packing.prompt_groups`); the same log-probs, loss and gradients within float32
  tolerance, fewer tokens through the model. Used for scored tokens (a ``loss_mask``) on the
  SDPA and eager attention paths.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from loongsage_core.backend_api import structure_args


@attrs.define(frozen=True)
class BackendOptions:
    """The validated ``[train] backend_args`` of the torch backend (see the module docstring)."""

    device: str = "auto"
    master_weights: str = attrs.field(default="float32", validator=attrs.validators.in_(("float32", "model")))
    forward_micro_batch_size: int | None = None
    dist_backend: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "gloo", "nccl")))
    grad_sync_bucket_mb: float = 64.0
    rollback_overflow: bool = True
    share_prompts: bool = True

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "BackendOptions":
        return structure_args(cls, args, "[train] backend_args", "torch backend")


def resolve_device(name: str) -> torch.device:
    """The torch device for ``backend_args.device`` (``auto`` picks the current CUDA device if any)."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"[train] backend_args.device = {name!r} but CUDA is not available")
    return device
