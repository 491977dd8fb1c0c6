"""KL estimators to a reference policy: ``fn(inputs: KLInputs, **args) -> Tensor [B, T]``.

Each returns per-token values (0 where the response mask is 0) and keeps the autograd graph of
``inputs.logprobs``: the host either adds ``kl_coef * aggregate(kl)`` to the loss, or detaches the
values and subtracts ``kl_coef * kl`` from the token rewards (``kl_in_reward``). Which one is the
host's decision; the estimators are the same.

Notation: ``d = logp - ref`` (log-prob of the sampled token under the policy minus under the
reference); samples come from the policy, so every estimator below estimates KL(policy || ref).

``clamp`` (optional, every estimator) bounds the per-token value to ``[-clamp, clamp]``; outside
the bound the gradient is 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loongsage_hookspecs import KLInputs

from . import _checks as chk

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def _log_diff(owner: str, inputs: Any) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(``d = logp - ref`` with 0 off the mask, bool mask)."""
    import torch

    if not isinstance(inputs, KLInputs):
        raise TypeError(f"{owner}: expected KLInputs, got {type(inputs).__name__}")
    mask = chk.mask_bool(owner, inputs.response_mask)
    logp = chk.float_tensor2d(owner, "logprobs", inputs.logprobs, mask)
    ref = chk.float_tensor2d(owner, "ref_logprobs", inputs.ref_logprobs, mask).to(logp.dtype).detach()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return torch.where(mask, logp, zero) - torch.where(mask, ref, zero), mask


def _finish(owner: str, kl: "torch.Tensor", mask: "torch.Tensor", clamp: Any) -> "torch.Tensor":
    import torch

    bound = chk.optional_number(owner, "clamp", clamp, low=0.0, low_open=True)
    if bound is not None:
        kl = kl.clamp(-bound, bound)
    return torch.where(mask, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))


def k1(inputs: KLInputs, *, clamp: float | None = None) -> "torch.Tensor":
    """``k1 = d``: unbiased, high variance, can be negative per token."""
    d, mask = _log_diff("k1", inputs)
    return _finish("k1", d, mask, clamp)


def k2(inputs: KLInputs, *, clamp: float | None = None) -> "torch.Tensor":
    """``k2 = d^2 / 2``: biased, low variance, never negative; as a loss its gradient is the
    on-policy gradient of KL(policy || ref)."""
    d, mask = _log_diff("k2", inputs)
    return _finish("k2", 0.5 * d * d, mask, clamp)


def _k3_values(owner: str, inputs: KLInputs, log_ratio_clamp: Any) -> tuple["torch.Tensor", "torch.Tensor"]:
    bound = chk.number(owner, "log_ratio_clamp", log_ratio_clamp, low=0.0, low_open=True)
    d, mask = _log_diff(owner, inputs)
    neg = (-d).clamp(-bound, bound)  # log(ref / pi)
    return neg.expm1() - neg, mask  # expm1: never below neg when rounded, so k3 >= 0 exactly


def k3(inputs: KLInputs, *, clamp: float | None = None, log_ratio_clamp: float = 20.0) -> "torch.Tensor":
    """``k3 = exp(ref - logp) - (ref - logp) - 1``: unbiased, low variance, never negative.
    ``ref - logp`` is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before ``exp``."""
    kl, mask = _k3_values("k3", inputs, log_ratio_clamp)
    return _finish("k3", kl, mask, clamp)


def low_var_kl(inputs: KLInputs, *, clamp: float | None = 10.0, log_ratio_clamp: float = 20.0) -> "torch.Tensor":
    """k3 with its value clamped to ``[-10, 10]`` by default (the "low_var_kl" of common RL
    stacks): a single token whose reference probability collapsed cannot dominate the loss."""
    kl, mask = _k3_values("low_var_kl", inputs, log_ratio_clamp)
    return _finish("low_var_kl", kl, mask, clamp)
