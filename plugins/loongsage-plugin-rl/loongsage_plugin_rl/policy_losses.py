"""Policy losses: ``fn(inputs: PolicyLossInputs, **args) -> PolicyLossOutput``.

Each loss returns a per-token loss ``[B, T]`` (never aggregated; the host applies correction
weights and masks and aggregates globally) and per-token metric tensors, detached, that the host
averages over the trained tokens. Tokens with response mask 0 get loss 0 and metrics 0, and
whatever they hold (NaN, inf, garbage) cannot reach the loss or its gradient: inputs are replaced
by 0 there before any arithmetic. Log-ratios are clamped to ``[-20, 20]`` before ``exp``.

Notation: ``lr_t = logp_t - old_t`` (current minus pre-update log-prob), ``r_t = exp(lr_t)``,
``A_t`` the advantage of the token. ``inputs.weights`` is ignored here (the host multiplies it in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from loongsage_hookspecs import PolicyLossInputs, PolicyLossOutput

from . import _checks as chk

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class _Tokens(NamedTuple):
    """Validated, mask-sanitised per-token tensors in the dtype of ``logprobs``."""

    mask: "torch.Tensor"
    logp: "torch.Tensor"
    old: "torch.Tensor"
    adv: "torch.Tensor"
    log_ratio: "torch.Tensor"


def _tokens(owner: str, inputs: Any) -> _Tokens:
    import torch

    if not isinstance(inputs, PolicyLossInputs):
        raise TypeError(f"{owner}: expected PolicyLossInputs, got {type(inputs).__name__}")
    mask = chk.mask_bool(owner, inputs.response_mask)
    logp = chk.float_tensor2d(owner, "logprobs", inputs.logprobs, mask)
    old = chk.float_tensor2d(owner, "old_logprobs", inputs.old_logprobs, mask).to(logp.dtype)
    adv = chk.float_tensor2d(owner, "advantages", inputs.advantages, mask).to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(mask, logp, zero)
    old = torch.where(mask, old.detach(), zero)
    adv = torch.where(mask, adv.detach(), zero)
    return _Tokens(mask, logp, old, adv, logp - old)


def _k3(log_ratio: "torch.Tensor") -> "torch.Tensor":
    """k3 estimate of KL(old || current) per token: ``exp(lr) - lr - 1`` with ``lr = logp - old``."""
    lr = log_ratio.detach().clamp(-chk.LOG_RATIO_CLAMP, chk.LOG_RATIO_CLAMP)
    return lr.exp() - lr - 1


def _masked(x: "torch.Tensor", tok: _Tokens) -> "torch.Tensor":
    """``x`` as a detached tensor in the dtype of the log-probs, 0 off the mask (a per-token metric)."""
    import torch

    x = x.detach().to(tok.logp.dtype)
    return torch.where(tok.mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _clip_args(owner: str, clip_low: Any, clip_high: Any) -> tuple[float, float]:
    low = chk.number(owner, "clip_low", clip_low, low=0.0, high=1.0)
    high = chk.number(owner, "clip_high", clip_high, low=0.0)
    return low, high


def ppo_clip(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2,
             dual_clip: float | None = None) -> PolicyLossOutput:
    """PPO clipped surrogate: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with
    ``dual_clip = c > 1`` the loss of negative-advantage tokens is capped at ``-A c``."""
    import torch

    owner = "ppo_clip"
    low, high = _clip_args(owner, clip_low, clip_high)
    dual = chk.optional_number(owner, "dual_clip", dual_clip, low=1.0, low_open=True)
    tok = _tokens(owner, inputs)
    ratio = tok.log_ratio.clamp(-chk.LOG_RATIO_CLAMP, chk.LOG_RATIO_CLAMP).exp()
    unclipped = -tok.adv * ratio
    clipped = -tok.adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "clip_ratio": _masked(clipped > unclipped, tok),
        "ratio": _masked(ratio, tok),
        "approx_kl": _masked(_k3(tok.log_ratio), tok),
    }
    if dual is not None:
        cap = -tok.adv * dual
        dual_active = (tok.adv < 0) & (loss > cap)
        loss = torch.where(tok.adv < 0, torch.minimum(loss, cap), loss)
        metrics["dual_clip_ratio"] = _masked(dual_active, tok)
    else:
        metrics["dual_clip_ratio"] = torch.zeros_like(metrics["clip_ratio"])
    loss = torch.where(tok.mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    return PolicyLossOutput(loss=loss, metrics=metrics)


def gspo(inputs: PolicyLossInputs, *, clip_low: float = 3e-4, clip_high: float = 4e-4) -> PolicyLossOutput:
    """GSPO (token form): ``s_i = exp(mean_t lr_t)`` over the row's trained tokens and
    ``s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t))`` (value ``s_i``, gradient ``s_i * grad logp_t``);
    loss ``max(-A s_{i,t}, -A clip(s_{i,t}, 1 - clip_low, 1 + clip_high))``."""
    import torch

    owner = "gspo"
    low, high = _clip_args(owner, clip_low, clip_high)
    tok = _tokens(owner, inputs)
    lengths = tok.mask.sum(dim=1).clamp_min(1).to(tok.logp.dtype)
    seq_log_ratio = tok.log_ratio.sum(dim=1) / lengths
    log_s = seq_log_ratio.detach()[:, None] + (tok.logp - tok.logp.detach())  # value exactly s_i
    s = log_s.clamp(-chk.LOG_RATIO_CLAMP, chk.LOG_RATIO_CLAMP).exp()
    unclipped = -tok.adv * s
    clipped = -tok.adv * s.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    loss = torch.where(tok.mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    return PolicyLossOutput(loss=loss, metrics={
        "clip_ratio": _masked(clipped > unclipped, tok),
        "ratio": _masked(s, tok),
        "approx_kl": _masked(_k3(tok.log_ratio), tok),
    })


def cispo(inputs: PolicyLossInputs, *, clip_low: float = 1.0, clip_high: float = 0.28) -> PolicyLossOutput:
    """CISPO: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``; every token keeps a
    gradient, only the size of its importance weight is bounded. ``clip_low = 1`` (default)
    means no lower bound."""
    import torch

    owner = "cispo"
    low, high = _clip_args(owner, clip_low, clip_high)
    tok = _tokens(owner, inputs)
    ratio = tok.log_ratio.detach().clamp(-chk.LOG_RATIO_CLAMP, chk.LOG_RATIO_CLAMP).exp()
    weight = ratio.clamp(1.0 - low, 1.0 + high)
    loss = -weight * tok.adv * tok.logp
    loss = torch.where(tok.mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    return PolicyLossOutput(loss=loss, metrics={
        "clip_ratio": _masked((ratio < 1.0 - low) | (ratio > 1.0 + high), tok),
        "ratio": _masked(ratio, tok),
        "approx_kl": _masked(_k3(tok.log_ratio), tok),
    })


def reinforce(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """Plain policy gradient: ``-A * logp`` (no ratio, no clipping)."""
    import torch

    tok = _tokens("reinforce", inputs)
    loss = torch.where(tok.mask, -tok.adv * tok.logp, torch.zeros((), dtype=tok.logp.dtype, device=tok.logp.device))
    ratio = tok.log_ratio.detach().clamp(-chk.LOG_RATIO_CLAMP, chk.LOG_RATIO_CLAMP).exp()
    return PolicyLossOutput(loss=loss, metrics={
        "ratio": _masked(ratio, tok),
        "approx_kl": _masked(_k3(tok.log_ratio), tok),
    })
