"""The critic's clipped value loss (PPO value clipping), per token and aggregated globally.

With ``V`` the critic's current values, ``V_old`` its values when the rows were collected (the
``values`` the advantage estimator saw) and ``R`` the value targets (``returns``), all ``[B, T]``::

    V_clip   = V_old + clamp(V - V_old, -clip, clip)
    loss_t   = 0.5 * max((V - R)^2, (V_clip - R)^2)          (clip > 0)
    loss_t   = 0.5 * (V - R)^2                               (clip = 0: no clipping)

The per-token loss is zeroed off the mask and reduced by the job's loss aggregation
(``[algorithm] loss_agg``) with the mini-batch's global :class:`AggregationNorm`, exactly as the
policy loss is, so a mini-batch's value loss does not depend on how it is split into micro-batches
and data-parallel ranks. A token counts as clipped when the clipped term is the larger one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from loongsage_hookspecs import AggregationNorm

Aggregate = Callable[["torch.Tensor", "torch.Tensor", "AggregationNorm"], "torch.Tensor"]


def clipped_value_loss(values: "torch.Tensor", old_values: "torch.Tensor", returns: "torch.Tensor",
                       mask: "torch.Tensor", norm: "AggregationNorm", *, clip: float, aggregate: Aggregate,
                       ) -> "tuple[torch.Tensor, dict[str, torch.Tensor]]":
    """The aggregated value loss (a scalar with gradient) and its metrics.

    Metrics: ``critic_loss`` (0-dim, this micro-batch's share of the mini-batch loss),
    ``value_mean`` and ``value_clip_frac`` (per-token ``[B, T]``, detached, for masked means).
    ``old_values`` / ``returns`` / ``mask`` are cast to the dtype and device of ``values``; entries
    where ``mask`` is 0 never reach the loss, whatever they hold.
    """
    import torch

    if clip < 0:
        raise ValueError(f"clipped_value_loss: clip must be >= 0 (0 disables clipping), got {clip}")
    shape = tuple(values.shape)
    for name, t in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if tuple(t.shape) != shape:
            raise ValueError(f"clipped_value_loss: {name} has shape {tuple(t.shape)}, values {shape}")
    device, dtype = values.device, values.dtype
    weights = mask.to(device=device, dtype=dtype)
    on = weights > 0
    zero = torch.zeros((), device=device, dtype=dtype)
    # sanitise off-mask entries first: NaN there must not leak into the loss or its gradient
    old = torch.where(on, old_values.to(device=device, dtype=dtype), zero)
    target = torch.where(on, returns.to(device=device, dtype=dtype), zero)
    v = torch.where(on, values, zero)
    unclipped = (v - target) ** 2
    if clip > 0:
        v_clip = old + torch.clamp(v - old, -clip, clip)
        clipped = (v_clip - target) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clip_frac = (clipped > unclipped).to(values.dtype)
    else:
        per_token = 0.5 * unclipped
        clip_frac = torch.zeros_like(unclipped)
    per_token = torch.where(on, per_token, zero)
    loss = aggregate(per_token, weights, norm)
    if loss.dim() != 0:
        raise ValueError(f"clipped_value_loss: the loss aggregation returned shape {tuple(loss.shape)}, "
                         "expected a scalar")
    metrics: dict[str, Any] = {"critic_loss": loss.detach(), "value_mean": v.detach(),
                               "value_clip_frac": clip_frac.detach()}
    return loss, metrics
