"""Off-policy corrections: ``fn(inputs: CorrectionInputs, **args) -> CorrectionOutput``.

The rollout engine and the trainer never compute exactly the same log-probs, and in asynchronous
training the engine may also lag the trainer by some versions. Corrections compare the trainer's
pre-update log-probs ``old`` with the engine's ``rollout`` log-probs (and, after the forward
pass, with the current ones) and return multiplicative per-token ``weights`` and/or a 0/1
``mask`` that the host multiplies into the per-token loss.

Conventions: every returned tensor is detached; off the response mask, weights and masks are
neutral (1), so a correction only ever changes trained tokens. Metrics are Python floats
(reported as ``train/<name>``), computed over the trained tokens of the rows passed in.
Throughout, ``r_t = old_t - rollout_t`` (``log pi_old / pi_rollout`` of the sampled token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from loongsage_hookspecs import CorrectionInputs, CorrectionOutput

from . import _checks as chk

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class _Tokens(NamedTuple):
    mask: "torch.Tensor"
    old: "torch.Tensor"
    rollout: "torch.Tensor"


def _tokens(owner: str, inputs: Any) -> _Tokens:
    """Validated log-probs, detached, with 0 off the mask (so garbage there cannot leak)."""
    import torch

    if not isinstance(inputs, CorrectionInputs):
        raise TypeError(f"{owner}: expected CorrectionInputs, got {type(inputs).__name__}")
    mask = chk.mask_bool(owner, inputs.response_mask)
    old = chk.float_tensor2d(owner, "old_logprobs", inputs.old_logprobs, mask).detach()
    rollout = chk.float_tensor2d(owner, "rollout_logprobs", inputs.rollout_logprobs, mask).detach().to(old.dtype)
    zero = torch.zeros((), dtype=old.dtype, device=old.device)
    return _Tokens(mask, torch.where(mask, old, zero), torch.where(mask, rollout, zero))


def _neutral(mask: "torch.Tensor", values: "torch.Tensor") -> "torch.Tensor":
    """``values`` on trained tokens, 1 elsewhere."""
    import torch

    return torch.where(mask, values, torch.ones((), dtype=values.dtype, device=values.device))


def _masked_mean(values: "torch.Tensor", mask: "torch.Tensor") -> float:
    n = int(mask.sum())
    return float(values[mask].double().sum() / n) if n else 0.0


def tis(inputs: CorrectionInputs, *, level: str = "token", mode: str = "clip", lower: float | None = None,
        upper: float = 2.0) -> CorrectionOutput:
    """Importance sampling against the rollout policy, ``w = exp(r)`` at one of three levels:
    ``token`` (``exp(r_t)``), ``sequence`` (``exp(sum_t r_t)``) or ``geometric``
    (``exp(mean_t r_t)``), the last two shared by every token of the row.

    ``mode = "clip"`` truncates the weights to ``[lower, upper]`` (``lower`` defaults to 0: upper
    truncation only); ``mode = "mask"`` keeps in-bound weights and masks tokens (token level) or
    whole rows (sequence levels) whose weight is outside (``lower`` defaults to ``1 / upper``).
    """
    import torch

    owner = "tis"
    level = chk.choice(owner, "level", level, ("token", "sequence", "geometric"))
    mode = chk.choice(owner, "mode", mode, ("clip", "mask"))
    upper = chk.number(owner, "upper", upper, low=0.0, low_open=True)
    if lower is None:
        if mode == "mask" and upper <= 1.0:
            raise ValueError(f"tis: mode 'mask' with upper={upper} <= 1 needs an explicit 'lower' "
                             "(the default lower bound 1 / upper would not be below upper)")
        lower = 0.0 if mode == "clip" else 1.0 / upper
    lower = chk.number(owner, "lower", lower, low=0.0, high=upper, high_open=True)
    tok = _tokens(owner, inputs)
    r = tok.old - tok.rollout
    if level == "token":
        log_w = r
    else:
        total = r.sum(dim=1, keepdim=True)
        if level == "geometric":
            total = total / tok.mask.sum(dim=1, keepdim=True).clamp_min(1).to(r.dtype)
        log_w = total.expand_as(r)
    w = log_w.clamp(-chk.LOG_RATIO_CLAMP, chk.LOG_RATIO_CLAMP).exp()
    outside = (w < lower) | (w > upper)
    if mode == "clip":
        weights = _neutral(tok.mask, w.clamp(lower, upper))
        out_mask = None
        effective = weights
    else:
        keep = ~outside
        weights = _neutral(tok.mask, torch.where(keep, w, torch.zeros_like(w)))
        out_mask = _neutral(tok.mask, keep.to(w.dtype))
        effective = weights * out_mask
    # float64 and expm1: exp(r) - r - 1 cancels to noise in fp32 for the tiny r of a consistent engine
    r_tok = r.clamp(-chk.LOG_RATIO_CLAMP, chk.LOG_RATIO_CLAMP).double()
    abs_diff = r.abs()
    metrics = {
        "is_clip_ratio": _masked_mean(outside.to(w.dtype), tok.mask),
        "is_weight_mean": _masked_mean(effective, tok.mask),
        "is_approx_k3_kl": _masked_mean(torch.expm1(r_tok) - r_tok, tok.mask),
        "logprob_abs_diff_mean": _masked_mean(abs_diff, tok.mask),
        "logprob_abs_diff_max": float(abs_diff[tok.mask].max()) if bool(tok.mask.any()) else 0.0,
    }
    return CorrectionOutput(weights=weights, mask=out_mask, metrics=metrics)


def m2po(inputs: CorrectionInputs, *, tau: float = 0.04) -> CorrectionOutput:
    """M2PO second-moment trust region: over all trained tokens passed in, mask the tokens with
    the largest ``r_t^2`` until the mean ``r_t^2`` of the kept tokens is ``<= tau``."""
    import torch

    owner = "m2po"
    tau = chk.number(owner, "tau", tau, low=0.0, low_open=True)
    tok = _tokens(owner, inputs)
    sq = ((tok.old - tok.rollout).double() ** 2)[tok.mask]
    n = sq.numel()
    keep_flat = torch.zeros(n, dtype=torch.bool, device=sq.device)
    kept = 0
    kept_moment = 0.0
    if n:
        ordered, order = torch.sort(sq, stable=True)
        prefix_mean = ordered.cumsum(0) / torch.arange(1, n + 1, dtype=torch.float64, device=sq.device)
        within = (prefix_mean <= tau).nonzero().flatten()
        if within.numel():
            kept = int(within.max()) + 1  # largest prefix of the smallest r^2 whose mean is <= tau
            keep_flat[order[:kept]] = True
            kept_moment = float(prefix_mean[kept - 1])
    keep = torch.zeros_like(tok.mask)
    keep[tok.mask] = keep_flat
    return CorrectionOutput(mask=_neutral(tok.mask, keep.to(tok.old.dtype)), metrics={
        "m2po_masked_ratio": (n - kept) / n if n else 0.0,
        "m2po_second_moment": float(sq.mean()) if n else 0.0,
        "m2po_second_moment_kept": kept_moment,
    })


def opsm(inputs: CorrectionInputs, *, delta: float = 1e-4, behavior: str = "rollout") -> CorrectionOutput:
    """Off-Policy Sequence Masking: mask every trained token of a row whose mean advantage is
    negative and whose sequence KL ``mean_t (behavior_t - logp_t)`` exceeds ``delta``
    (``behavior`` = rollout or old log-probs, ``logp`` the current ones). Runs post forward."""
    import torch

    owner = "opsm"
    delta = chk.number(owner, "delta", delta, low=0.0)
    behavior = chk.choice(owner, "behavior", behavior, ("rollout", "old"))
    tok = _tokens(owner, inputs)
    if inputs.logprobs is None:
        raise ValueError("opsm: inputs.logprobs (current policy) is None; OPSM runs at stage post_forward")
    if inputs.advantages is None:
        raise ValueError("opsm: inputs.advantages is None; OPSM masks only negative-advantage sequences")
    zero = torch.zeros((), dtype=tok.old.dtype, device=tok.old.device)
    current = torch.where(tok.mask, chk.float_tensor2d(owner, "logprobs", inputs.logprobs, tok.mask)
                          .detach().to(tok.old.dtype), zero)
    adv = torch.where(tok.mask, chk.float_tensor2d(owner, "advantages", inputs.advantages, tok.mask)
                      .detach().to(tok.old.dtype), zero)
    ref = tok.rollout if behavior == "rollout" else tok.old
    lengths = tok.mask.sum(dim=1)
    denom = lengths.clamp_min(1).to(tok.old.dtype)
    seq_kl = (ref - current).sum(dim=1) / denom
    seq_adv = adv.sum(dim=1) / denom
    has_tokens = lengths > 0
    drop = has_tokens & (seq_adv < 0) & (seq_kl > delta)
    keep = (~drop)[:, None].expand_as(tok.mask).to(tok.old.dtype)
    n_rows = int(has_tokens.sum())
    return CorrectionOutput(mask=_neutral(tok.mask, keep), metrics={
        "opsm_clipfrac": int(drop.sum()) / n_rows if n_rows else 0.0,
        "opsm_seq_kl_mean": float(seq_kl[has_tokens].double().mean()) if n_rows else 0.0,
    })
