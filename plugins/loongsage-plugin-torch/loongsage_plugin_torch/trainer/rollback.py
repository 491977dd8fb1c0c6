"""Taking back an optimizer step whose update overflowed the weights.

A finite learning rate and finite gradients can still push a parameter to ``inf``/``NaN`` (an
``lr`` far too large, an Adam state that blew up), or make torch stop part-way through the step
because a step size does not fit a float (:func:`is_overflow_error`, some parameters already
updated). Such weights cannot be repaired afterwards, so
before an optimizer step that might overflow :class:`StepSnapshot` copies the parameters and the
optimizer's per-parameter state (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``) on their own
device; when a parameter is not finite after the step, :meth:`StepSnapshot.restore` copies
everything back, bit for bit, and state the step created is dropped again.

The copy is three times the parameters' bytes, read and written (on a 135M-parameter model on
the 2-core CPU about 0.27 s of a 3.7 s training step; on a GPU, memory for a second copy of the
weights and both moments). Almost every step provably cannot overflow, so
:func:`adamw_step_cannot_overflow` first bounds the largest weight AdamW's update can produce
from one read of the weights and the first moments, and the copy is taken only when that bound
comes near the float range (a huge ``lr`` or ``weight_decay``, a broken optimizer state).
``[train] backend_args.rollback_overflow = false`` skips both; an overflow then ends the run.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

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


#: the largest weight a step may provably reach and still skip the snapshot: far below the
#: float32 and bfloat16 maximum (3.4e38), so neither rounding in the bound's own arithmetic nor
#: in the kernel's can carry a weight past the range
SAFE_WEIGHT_BOUND = 1e30


def _largest_magnitude(tensors: Iterable[torch.Tensor]) -> float:
    """``max |x|`` over ``tensors`` (0 for none); ``nan`` when any holds a ``nan``, ``inf`` an ``inf``.

    One ``aminmax`` pass each (a third of the cost of copying the tensor, a quarter of
    ``linalg.vector_norm(ord=inf)`` on the CPU) and one transfer of the results to the host."""
    with torch.no_grad():
        extremes = [torch.stack(t.detach().aminmax()).float() for t in tensors if t.numel()]
        if not extremes:
            return 0.0
        magnitudes = torch.stack(extremes).abs()
        if bool(magnitudes.isnan().any()):
            return math.nan
        return float(magnitudes.max())


def adamw_weight_bound(optimizer: torch.optim.Optimizer, grad_bound: float) -> float:
    """An upper bound on ``|w|`` after the next :class:`torch.optim.AdamW` step over every weight
    with a gradient, given that no gradient element exceeds ``grad_bound`` in magnitude (the
    clipped total norm bounds it); ``inf`` where the bound does not apply.

    Per parameter group, with ``W = max |w|`` and ``M = max |exp_avg|`` before the step, the step
    (decoupled decay, then ``w -= lr / (1 - b1^t) * m / (sqrt(v_hat) + eps)``) gives::

        |w'| <= W |1 - lr wd| + lr / (1 - b1) * (b1 M + (1 - b1) G) / eps

    because ``|m| <= b1 M + (1 - b1) G``, the bias correction ``1 - b1^t >= 1 - b1`` and the
    denominator is at least ``eps`` (the second moments AdamW keeps are never negative). ``inf``
    when the step size ``lr / (1 - b1^t)`` or ``lr wd`` itself nears the float range (times a
    zero update it makes ``nan``), for another optimizer, ``eps <= 0``, ``b1`` outside
    ``[0, 1)``, a non-finite weight, moment or hyperparameter, or a ``G`` whose square overflows
    float32.
    """
    if not isinstance(optimizer, torch.optim.AdamW) or not math.isfinite(grad_bound) or grad_bound > 1e18:
        return math.inf
    largest = 0.0
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        lr, eps, decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        beta1 = float(group["betas"][0])
        if not (eps > 0.0 and 0.0 <= beta1 < 1.0 and math.isfinite(lr) and math.isfinite(decay)):
            return math.inf
        if abs(lr) / (1.0 - beta1) >= SAFE_WEIGHT_BOUND or abs(lr * decay) >= SAFE_WEIGHT_BOUND:
            return math.inf  # the kernel's own step size or decay factor overflows (inf * 0 is nan)
        weights = _largest_magnitude(params)
        moments = _largest_magnitude(optimizer.state[p]["exp_avg"] for p in params
                                     if "exp_avg" in optimizer.state.get(p, {}))
        if not (math.isfinite(weights) and math.isfinite(moments)):
            return math.inf
        moment = beta1 * moments + (1.0 - beta1) * grad_bound
        largest = max(largest, weights * abs(1.0 - lr * decay) + abs(lr) / (1.0 - beta1) * moment / eps)
    return largest


def adamw_step_cannot_overflow(optimizer: torch.optim.Optimizer, grad_bound: float) -> bool:
    """Whether the next AdamW step provably leaves every weight finite: its
    :func:`adamw_weight_bound` stays below :data:`SAFE_WEIGHT_BOUND`. ``False`` also where the
    bound does not apply; the caller then takes the snapshot."""
    return adamw_weight_bound(optimizer, grad_bound) < SAFE_WEIGHT_BOUND


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
