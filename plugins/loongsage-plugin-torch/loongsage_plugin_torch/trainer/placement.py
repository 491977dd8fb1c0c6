"""Where a torch train worker's state lives: on its device, or offloaded to the CPU while the
accelerator serves rollouts (colocated runs), and the process group it leaves on close.

:class:`PlacementMixin` is separate from training and checkpoints because it only moves what
they own (parameters, gradients, optimizer state); the forward and training methods refuse to
run while :attr:`_offloaded` is set.
"""

from __future__ import annotations

from typing import Any

import torch


class PlacementMixin:
    """Offload, onload and close of a worker; the attributes below are set by the worker's ``__init__``."""

    model: Any
    device: torch.device
    optimizer: torch.optim.Optimizer | None
    _offloaded: bool

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to the CPU (frees the accelerator)."""
        self._move(torch.device("cpu"))
        self._offloaded = self.device.type != "cpu"
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Move everything :meth:`offload` moved back to the worker's device."""
        self._move(self.device)
        self._offloaded = False

    def _move(self, device: torch.device) -> None:
        """Move the model and the optimizer's tensor state to ``device`` (a CPU worker keeps them)."""
        if self.device.type == "cpu":
            return
        self.model.to(device)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def close(self) -> None:
        """Leave the process group (if this worker joined one)."""
        import torch.distributed as dist

        if self.optimizer is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
