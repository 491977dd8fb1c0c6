"""Moving a megatron worker's model and optimizer state between the accelerator and host memory.

Between phases of a step (e.g. while the rollout engine generates) a colocated worker frees the
accelerator: parameters and optimizer state go to host memory, gradient buffers are released
(they are scratch between steps). Parameters keep their CUDA device and identity: their storage
is emptied and refilled (as Megatron's buffers do), because moving a parameter's ``.data`` to
another device resets its gradient accumulator and would drop the backward hooks Megatron DDP
put there. Under bfloat16 / float16 the optimizer's float32 master weights move with its Adam
state. On the CPU there is nothing to move: both directions are no-ops.
"""

from __future__ import annotations

from typing import Any

import torch

from .optimizer import grad_buffers
from .schedule import megatron_optimizers


class HostOffload:
    """Offloads one worker's model chunks and optimizer state to host memory and brings them back.

    ``modules`` are the unwrapped model chunks, ``chunks`` what runs them (the same, or their
    Megatron DDP wrappers), ``optimizer`` the Megatron optimizer (None for a forward-only
    worker); ``params_in_buffers`` says the parameters live in Megatron DDP's parameter buffers
    (the distributed optimizer), which move them themselves.
    """

    def __init__(self, device: torch.device, modules: list[Any], chunks: list[Any], optimizer: Any,
                 params_in_buffers: bool) -> None:
        self.device = device
        self.modules, self.chunks, self.optimizer = modules, chunks, optimizer
        self.params_in_buffers = params_in_buffers
        self.offloaded = False
        self._param_backup: dict[torch.nn.Parameter, torch.Tensor] = {}

    def offload(self) -> None:
        """Parameters and optimizer state to host memory, gradient buffers released; then the
        CUDA cache is emptied. A no-op on the CPU and when already offloaded."""
        if self.device.type == "cpu" or self.offloaded:
            return
        torch.cuda.synchronize(self.device)
        for buffer in grad_buffers(self.chunks):
            buffer.offload_to_cpu(move_params=self.params_in_buffers, move_grads=True)
        self._param_backup = {}
        if not self.params_in_buffers:
            for param in self._unique_params():
                self._param_backup[param] = param.detach().to("cpu")
                param.data.untyped_storage().resize_(0)
        self._move_optimizer_state(torch.device("cpu"))
        self.offloaded = True
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring back everything :meth:`offload` moved (gradient buffers come back zeroed)."""
        if not self.offloaded:
            return
        for param, saved in self._param_backup.items():
            param.data.untyped_storage().resize_(saved.numel() * saved.element_size())
            param.data.copy_(saved)
        self._param_backup = {}
        for buffer in grad_buffers(self.chunks):
            buffer.reload_from_cpu(move_params=self.params_in_buffers, move_grads=True)
        self._move_optimizer_state(self.device)
        torch.cuda.synchronize(self.device)
        self.offloaded = False

    def _unique_params(self) -> list[torch.nn.Parameter]:
        return list({id(p): p for chunk in self.modules for p in chunk.parameters()}.values())

    def _move_optimizer_state(self, device: torch.device) -> None:
        if self.optimizer is None:
            return
        # bfloat16 / float16: the mixed-precision optimizer's float32 master weights (optimizer
        # tensors with no backward hooks: their ``.data`` moves)
        for sub in megatron_optimizers(self.optimizer):
            for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
                for group in getattr(sub, name, None) or []:
                    for main_param in group:
                        main_param.data = main_param.data.to(device, non_blocking=True)
        for _, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
