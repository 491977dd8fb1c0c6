"""Loss aggregations ``fn(loss [B, T], mask [B, T], norm: AggregationNorm, **args) -> scalar``.

A mini-batch is trained as several micro-batches whose aggregated losses are summed before the
optimizer step. Every aggregation here divides only by the global statistics in ``norm`` (computed
once over all micro-batches of the mini-batch, and across data-parallel ranks, by the host's
``compute_norm``), never by a micro-batch's own token or row count,
so the mini-batch loss and its gradient are the same however the mini-batch is split.

``mask`` multiplies the loss (it may carry weights); entries where it is 0 never contribute, even
if the loss holds NaN or inf there. A row's length is its number of nonzero mask entries.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from loongsage_hookspecs import AggregationNorm

from . import _checks as chk

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def _weighted(owner: str, loss: Any, mask: Any, norm: Any) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(``loss * mask`` with exact zeros where the mask is 0, bool mask)."""
    import torch

    loss = chk.float_tensor2d(owner, "loss", loss)
    mask = chk.tensor2d(owner, "mask", mask)
    if mask.shape != loss.shape:
        raise ValueError(f"{owner}: mask has shape {tuple(mask.shape)} but loss has shape {tuple(loss.shape)}")
    if not isinstance(norm, AggregationNorm):
        raise TypeError(f"{owner}: norm must be an AggregationNorm (the host's compute_norm), "
                        f"got {type(norm).__name__}")
    for field in ("num_tokens", "num_sequences", "max_response_length"):
        value = getattr(norm, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{owner}: norm.{field} must be a finite number >= 0, got {value!r}")
    nonzero = mask != 0
    weighted = torch.where(nonzero, loss * mask.to(loss.dtype), torch.zeros((), dtype=loss.dtype, device=loss.device))
    return weighted, nonzero


def _divide(owner: str, total: "torch.Tensor", denom: float, nonzero: "torch.Tensor", what: str) -> "torch.Tensor":
    if denom > 0:
        return total / denom
    if bool(nonzero.any()):
        raise ValueError(f"{owner}: {what} is 0 but the mask has trained tokens; build the norm with "
                         "the norm over the masks of the whole mini-batch")
    return total  # no trained token anywhere: the loss is an exact 0 that keeps the graph


def token_mean(loss: "torch.Tensor", mask: "torch.Tensor", norm: AggregationNorm) -> "torch.Tensor":
    """``sum(loss * mask) / norm.num_tokens``: every trained token of the mini-batch weighs the same."""
    weighted, nonzero = _weighted("token_mean", loss, mask, norm)
    return _divide("token_mean", weighted.sum(), norm.num_tokens, nonzero, "norm.num_tokens")


def seq_mean_token_sum(loss: "torch.Tensor", mask: "torch.Tensor", norm: AggregationNorm) -> "torch.Tensor":
    """``sum_i sum_t loss * mask / norm.num_sequences``: longer rows weigh more."""
    weighted, nonzero = _weighted("seq_mean_token_sum", loss, mask, norm)
    return _divide("seq_mean_token_sum", weighted.sum(), norm.num_sequences, nonzero, "norm.num_sequences")


def seq_mean_token_mean(loss: "torch.Tensor", mask: "torch.Tensor", norm: AggregationNorm) -> "torch.Tensor":
    """``sum_i (sum_t loss * mask / len_i) / norm.num_sequences``: every row weighs the same."""
    owner = "seq_mean_token_mean"
    weighted, nonzero = _weighted(owner, loss, mask, norm)
    lengths = nonzero.sum(dim=1).clamp_min(1).to(weighted.dtype)
    return _divide(owner, (weighted.sum(dim=1) / lengths).sum(), norm.num_sequences, nonzero, "norm.num_sequences")


def seq_mean_token_sum_norm(loss: "torch.Tensor", mask: "torch.Tensor", norm: AggregationNorm, *,
                            max_len: float | None = None) -> "torch.Tensor":
    """Dr. GRPO: ``sum(loss * mask) / (norm.num_sequences * L)`` with the constant ``L = max_len``
    (e.g. the generation budget) or, when unset, ``norm.max_response_length``."""
    owner = "seq_mean_token_sum_norm"
    length = chk.optional_number(owner, "max_len", max_len, low=0.0, low_open=True)
    weighted, nonzero = _weighted(owner, loss, mask, norm)
    if length is None:
        length = float(norm.max_response_length)
    return _divide(owner, weighted.sum(), norm.num_sequences * length, nonzero,
                   "norm.num_sequences * max response length")
