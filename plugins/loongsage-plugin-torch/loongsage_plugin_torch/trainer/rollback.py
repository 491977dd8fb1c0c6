"""Taking back an optimizer step whose update overflowed the weights.

A finite learning rate and finite gradients can still push a parameter to ``inf``/``NaN`` (an
``lr`` far too large, an Adam state that blew up), or make torch stop part-way through the step
because a step size does not fit a float (:func:`is_overflow_error`, some parameters already
updated). Such weights cannot be repaired afterwards, so
before each optimizer step :class:`StepSnapshot` copies the parameters and the optimizer's
per-parameter state (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``) on their own device; when a
parameter is not finite after the step, :meth:`StepSnapshot.restore` copies everything back, bit
for bit, and state the step created is dropped again. The cost is one copy of the parameters
and the optimizer state per step (``[train] backend_args.rollback_overflow = false`` saves it;
an overflow then ends the run).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def is_overflow_error(exc: BaseException) -> bool:
    """Whether ``exc`` is torch refusing a step size beyond the float range (``lr`` far too large:
    ``value cannot be converted to type float without overflow``), raised part-way through a step."""
    return isinstance(exc, RuntimeError) and "without overflow" in str(exc)


def nonfinite_count(params: Sequence[torch.Tensor]) -> int:
    """How many of ``params`` hold a value that is not finite.

    Checked after every optimizer step, so the usual answer (none) must be cheap: one summing pass
    over each parameter (an ``inf`` or ``NaN`` anywhere makes the total non-finite) instead of
    ``isfinite`` (five passes). Only a non-finite total, which finite weights reach only past
    ``3e38``, pays for the exact count per parameter.
    """
    if not params:
        return 0
    with torch.no_grad():
        total = torch.stack([p.detach().sum(dtype=torch.float32) for p in params]).sum()
        if bool(torch.isfinite(total)):
            return 0
        return sum(not bool(torch.isfinite(p).all()) for p in params)


class StepSnapshot:
    """The parameters and optimizer state before one optimizer step (see the module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        with torch.no_grad():
            self.values = [p.detach().clone() for p in self.params]
            self.state: dict[int, dict[str, Any]] = {
                id(p): {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
                for p, state in optimizer.state.items()}

    def restore(self) -> None:
        """Put the parameters and the optimizer state back as they were when this was taken."""
        with torch.no_grad():
            for p, value in zip(self.params, self.values):
                p.copy_(value)
            for p in list(self.optimizer.state.keys()):
                saved = self.state.get(id(p))
                if saved is None:  # created by the step taken back
                    del self.optimizer.state[p]
                    continue
                current = self.optimizer.state[p]
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor) and isinstance(current.get(key), torch.Tensor) \
                            and current[key].shape == value.shape:
                        current[key].copy_(value)
                    else:
                        current[key] = value
