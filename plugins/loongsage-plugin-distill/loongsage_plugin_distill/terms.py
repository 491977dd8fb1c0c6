"""On-policy distillation terms: ``fn(inputs: KLInputs, **args) -> Tensor [B, T]``.

Notation (per token position ``t`` of a row): ``pi`` is the student (the policy being trained),
``q`` the teacher, ``y_t`` the sampled token (drawn from the student, so the data are on-policy),
``d_t = log pi(y_t) - log q(y_t)`` (``inputs.logprobs - inputs.ref_logprobs``).

Every term returns one value per token, exactly 0 where ``response_mask`` is 0, and is never
aggregated (the host aggregates with the job's loss aggregation). Teacher tensors are always
detached; only the student side carries gradient. Two families:

* PG style (:func:`pg`): a detached per-token value the host folds into the advantages,
  ``advantage -= coef * value``; the policy loss then does the optimisation.
* GKD style (:func:`k2`, :func:`k3`, :func:`topk_kl`, :func:`full_kl`, :func:`jsd`): differentiable
  per-token divergences the host adds to the loss, ``loss += coef * aggregate(value)``.

:class:`MixTerm` combines one of each into a single differentiable loss term. The formulas, and
which job-file arguments each term takes, are in the package README.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from loongsage_hookspecs import KLInputs

from . import _checks as chk

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

DIRECTIONS = ("forward", "reverse")
"""``forward`` = KL(teacher || student) (mass covering), ``reverse`` = KL(student || teacher)
(mode seeking, the divergence on-policy distillation minimises)."""

TOPK_MODES = ("tail", "renorm")
"""How :func:`topk_kl` treats the vocabulary outside the teacher's top-k (see its docstring)."""


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


def _inputs(owner: str, inputs: Any) -> KLInputs:
    if not isinstance(inputs, KLInputs):
        raise TypeError(f"{owner}: expected KLInputs, got {type(inputs).__name__}")
    return inputs


def _log_diff(owner: str, inputs: Any) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """(``d = logp - ref`` with 0 off the mask, the masked ``logp``, bool mask)."""
    import torch

    x = _inputs(owner, inputs)
    mask = chk.mask_bool(owner, x.response_mask)
    logp = chk.token_tensor(owner, "logprobs", x.logprobs, mask)
    ref = chk.token_tensor(owner, "ref_logprobs", x.ref_logprobs, mask).detach().to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(mask, logp, zero)
    return logp - torch.where(mask, ref.to(logp.device), zero), logp, mask


def _finish(owner: str, values: "torch.Tensor", mask: "torch.Tensor", clamp: Any) -> "torch.Tensor":
    """``values`` clamped to ``[-clamp, clamp]`` (when set) and exactly 0 off the mask."""
    import torch

    bound = chk.optional_number(owner, "clamp", clamp, low=0.0, low_open=True)
    if bound is not None:
        values = values.clamp(-bound, bound)
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _scatter(values: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    """Per-trained-token ``values`` ``[N]`` placed into a ``[B, T]`` tensor, 0 elsewhere."""
    import torch

    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(mask.to(values.device), values)


def kl_rows(log_a: "torch.Tensor", log_b: "torch.Tensor") -> "torch.Tensor":
    """``KL(a || b) = sum_v a_v (log a_v - log b_v)`` over the last dimension.

    Entries with ``a_v = 0`` contribute exactly 0 (also when ``log b_v = -inf``), with no NaN in
    the value or in the gradient.
    """
    import torch

    p = log_a.exp()
    diff = torch.where(p > 0, log_a - log_b, torch.zeros((), dtype=log_a.dtype, device=log_a.device))
    return (p * diff).sum(-1)


def _vocab(owner: str, name: str, tensor: "torch.Tensor", vocab_size: int | None) -> "torch.Tensor":
    if vocab_size is None:
        return tensor
    if tensor.shape[-1] < vocab_size:
        raise ValueError(f"{owner}: {name} has {tensor.shape[-1]} vocabulary entries, fewer than "
                         f"vocab_size={vocab_size}")
    return tensor[..., :vocab_size]


def _logit_rows(owner: str, inputs: KLInputs, mask: "torch.Tensor", vocab_size: Any,
                ) -> "tuple[torch.Tensor, torch.Tensor]":
    """Student and (detached) teacher log-softmax rows ``[N, V]`` of the trained tokens."""
    import torch

    size = None if vocab_size is None else chk.integer(owner, "vocab_size", vocab_size, low=1)
    student = chk.vocab_tensor(owner, "logits", inputs.logits, mask)
    teacher = chk.vocab_tensor(owner, "ref_logits", inputs.ref_logits, mask).detach()
    student = _vocab(owner, "logits", student, size)
    teacher = _vocab(owner, "ref_logits", teacher, size)
    if student.shape[-1] != teacher.shape[-1]:
        raise ValueError(f"{owner}: student logits have {student.shape[-1]} vocabulary entries but teacher "
                         f"ref_logits have {teacher.shape[-1]}; set the argument vocab_size to the shared "
                         f"vocabulary (e.g. {min(student.shape[-1], teacher.shape[-1])}) to compare the first "
                         "vocab_size entries of both")
    dtype = chk.compute_dtype(student)
    rows_s = student[mask.to(student.device)].to(dtype)
    rows_t = teacher[mask.to(teacher.device)].to(device=rows_s.device, dtype=dtype)
    return torch.log_softmax(rows_s, -1), torch.log_softmax(rows_t, -1)


# --------------------------------------------------------------------------------------------
# PG style
# --------------------------------------------------------------------------------------------


def pg(inputs: KLInputs, *, clamp: float | None = None) -> "torch.Tensor":
    """``value_t = d_t = log pi(y_t) - log q(y_t)``, detached (no gradient).

    The per-token sampled estimate of the reverse KL(pi || q). It is meant as a per-token
    reward/advantage term: the host computes ``advantage_t -= coef * value_t`` (with the job's
    ``kl_in_reward = true`` the host subtracts it from the token rewards instead) and the policy
    loss does the optimisation. Added to the loss directly it would contribute no gradient.
    ``clamp`` bounds the value to ``[-clamp, clamp]``.
    """
    d, _, mask = _log_diff("opd_pg", inputs)
    return _finish("opd_pg", d.detach(), mask, clamp)


def penalize_advantages(advantages: "torch.Tensor", pg_value: "torch.Tensor", *, coef: float,
                        mask: "torch.Tensor | None" = None) -> "torch.Tensor":
    """``advantages - coef * pg_value`` (0 off ``mask`` when given): how the host uses :func:`pg`."""
    import torch

    c = chk.number("penalize_advantages", "coef", coef)
    if tuple(advantages.shape) != tuple(pg_value.shape):
        raise ValueError(f"penalize_advantages: advantages {tuple(advantages.shape)} and pg_value "
                         f"{tuple(pg_value.shape)} must have the same [B, T] shape")
    out = advantages - c * pg_value.detach().to(advantages.dtype)
    if mask is not None:
        out = torch.where(chk.mask_bool("penalize_advantages", mask), out, torch.zeros_like(out))
    return out


# --------------------------------------------------------------------------------------------
# GKD style: sampled-token estimators
# --------------------------------------------------------------------------------------------


def k2(inputs: KLInputs, *, clamp: float | None = None) -> "torch.Tensor":
    """``k2_t = d_t^2 / 2``. Never negative; its gradient ``d_t * grad log pi(y_t)`` is, in
    expectation over on-policy samples, the gradient of the reverse KL(pi || q)."""
    d, _, mask = _log_diff("opd_k2", inputs)
    return _finish("opd_k2", 0.5 * d * d, mask, clamp)


def k3(inputs: KLInputs, *, clamp: float | None = None,
       log_ratio_clamp: float = chk.LOG_RATIO_CLAMP) -> "torch.Tensor":
    """``k3_t = exp(-d_t) + d_t - 1`` (``exp(log q - log pi) - (log q - log pi) - 1``).

    Never negative and an unbiased estimate of the reverse KL(pi || q); its gradient
    ``(1 - q/pi) grad log pi`` is, in expectation, the gradient of the forward KL(q || pi).
    ``-d_t`` is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before ``exp``.
    """
    bound = chk.number("opd_k3", "log_ratio_clamp", log_ratio_clamp, low=0.0, low_open=True)
    d, _, mask = _log_diff("opd_k3", inputs)
    neg = (-d).clamp(-bound, bound)
    return _finish("opd_k3", neg.exp() - neg - 1.0, mask, clamp)


# --------------------------------------------------------------------------------------------
# GKD style: vocabulary-level divergences
# --------------------------------------------------------------------------------------------


def topk_kl(inputs: KLInputs, *, k: int | None = None, direction: str = "reverse", mode: str = "tail",
            tail_eps: float = 1e-8, vocab_size: int | None = None) -> "torch.Tensor":
    """KL between student and teacher over the teacher's top-k support ``S_t``.

    Needs ``logits`` (student, ``[B, T, V]``) and ``ref_topk_ids`` / ``ref_topk_logprobs``
    (teacher, ``[B, T, K]``, distinct ids). ``k`` (default ``K``) keeps the ``k`` ids with the
    largest teacher log-probs. ``mode``:

    * ``"tail"``: a ``k + 1``-bucket distribution, the ``k`` ids plus one bucket for the rest of
      the vocabulary (teacher tail ``1 - sum_S q``, student tail ``sum_{v not in S} pi_v``). A
      coarse-graining of the full distributions, so never above the full-vocabulary KL, and equal
      to it when ``S`` is the whole vocabulary. Tail log-masses are floored at ``log(tail_eps)``.
    * ``"renorm"``: both distributions restricted to ``S`` and renormalised to sum to 1.

    ``direction`` ``"reverse"`` = KL(pi || q), ``"forward"`` = KL(q || pi), over those buckets.
    ``vocab_size`` compares only the first ``vocab_size`` student logits (padded vocabularies).
    """
    import torch

    owner = "opd_topk_kl"
    x = _inputs(owner, inputs)
    direction = chk.choice(owner, "direction", direction, DIRECTIONS)
    mode = chk.choice(owner, "mode", mode, TOPK_MODES)
    eps = chk.number(owner, "tail_eps", tail_eps, low=0.0, high=1.0, low_open=True, high_open=True)
    size = None if vocab_size is None else chk.integer(owner, "vocab_size", vocab_size, low=1)
    mask = chk.mask_bool(owner, x.response_mask)
    logits = _vocab(owner, "logits", chk.vocab_tensor(owner, "logits", x.logits, mask), size)
    ids = chk.vocab_tensor(owner, "ref_topk_ids", x.ref_topk_ids, mask, floating=False)
    lq = chk.vocab_tensor(owner, "ref_topk_logprobs", x.ref_topk_logprobs, mask).detach()
    if ids.shape != lq.shape:
        raise ValueError(f"{owner}: ref_topk_ids {tuple(ids.shape)} and ref_topk_logprobs {tuple(lq.shape)} "
                         "must have the same shape")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{owner}: ref_topk_ids must be an integer tensor, got dtype {ids.dtype}")
    width = ids.shape[-1]
    kk = width if k is None else chk.integer(owner, "k", k, low=1)
    if kk > width:
        raise ValueError(f"{owner}: argument 'k'={kk} exceeds the {width} teacher top-k entries in the batch; "
                         f"ask the teacher for at least {kk}")

    dtype = chk.compute_dtype(logits)
    dev = logits.device
    rows_s = logits[mask.to(dev)].to(dtype)
    support = ids[mask.to(ids.device)].to(device=dev, dtype=torch.long)
    lq = lq[mask.to(lq.device)].to(device=dev, dtype=dtype)
    vocab = rows_s.shape[-1]
    if support.numel() and (int(support.min()) < 0 or int(support.max()) >= vocab):
        raise ValueError(f"{owner}: ref_topk_ids on trained tokens must lie in [0, {vocab}) (the student "
                         f"vocabulary), got ids in [{int(support.min())}, {int(support.max())}]")
    if kk < width:
        lq, pos = lq.topk(kk, dim=-1)
        support = support.gather(-1, pos)

    log_pi = torch.log_softmax(rows_s, -1)
    lp = log_pi.gather(-1, support)
    if mode == "renorm":
        lq_n, lp_n = torch.log_softmax(lq, -1), torch.log_softmax(lp, -1)
        value = kl_rows(lq_n, lp_n) if direction == "forward" else kl_rows(lp_n, lq_n)
        return _scatter(value, mask)

    log_eps = math.log(eps)
    q_tail = (1.0 - lq.exp().sum(-1)).clamp_min(0.0)
    lq_tail = q_tail.clamp_min(eps).log()
    rest = log_pi.scatter(-1, support, torch.finfo(dtype).min)  # the ids outside S keep their log-probs
    lp_tail_raw = rest.logsumexp(-1)
    lp_tail = lp_tail_raw.clamp_min(log_eps)
    if direction == "forward":
        value = kl_rows(lq, lp) + q_tail * (lq_tail - lp_tail)
    else:
        value = kl_rows(lp, lq) + lp_tail_raw.exp() * (lp_tail - lq_tail)
    return _scatter(value, mask)


def full_kl(inputs: KLInputs, *, direction: str = "reverse", vocab_size: int | None = None) -> "torch.Tensor":
    """Exact KL over the full vocabulary from both sides' logits.

    ``direction`` ``"reverse"`` = KL(pi || q) = ``sum_v pi_v (log pi_v - log q_v)``; ``"forward"`` =
    KL(q || pi). Needs ``logits`` and ``ref_logits``; ``vocab_size`` compares only the first
    ``vocab_size`` entries of both (student and teacher with differently padded vocabularies).
    """
    owner = "opd_full_kl"
    x = _inputs(owner, inputs)
    direction = chk.choice(owner, "direction", direction, DIRECTIONS)
    mask = chk.mask_bool(owner, x.response_mask)
    log_pi, log_q = _logit_rows(owner, x, mask, vocab_size)
    value = kl_rows(log_q, log_pi) if direction == "forward" else kl_rows(log_pi, log_q)
    return _scatter(value, mask)


def jsd(inputs: KLInputs, *, beta: float = 0.5, normalize: bool = False,
        vocab_size: int | None = None) -> "torch.Tensor":
    """Generalised Jensen-Shannon divergence over the full vocabulary.

    With mixture ``m = beta * q + (1 - beta) * pi``::

        JSD_beta = beta * KL(q || m) + (1 - beta) * KL(pi || m)      (0 < beta < 1)
        JSD_0    = KL(q || pi)   (forward KL)
        JSD_1    = KL(pi || q)   (reverse KL)

    ``beta = 0.5`` is the symmetric JSD (bounded by ``log 2``). The interior formula tends to 0 at
    both ends, so the endpoints are defined as the limits of ``JSD_beta / beta`` (at 0) and
    ``JSD_beta / (1 - beta)`` (at 1). ``normalize = true`` divides the interior by
    ``beta * (1 - beta)``, which makes the value continuous in ``beta`` with exactly those
    endpoints (and 4 x the symmetric JSD at 0.5).
    """
    import torch

    owner = "opd_jsd"
    x = _inputs(owner, inputs)
    b = chk.number(owner, "beta", beta, low=0.0, high=1.0)
    norm = chk.flag(owner, "normalize", normalize)
    mask = chk.mask_bool(owner, x.response_mask)
    log_pi, log_q = _logit_rows(owner, x, mask, vocab_size)
    if b == 0.0:
        value = kl_rows(log_q, log_pi)
    elif b == 1.0:
        value = kl_rows(log_pi, log_q)
    else:
        log_m = torch.logsumexp(torch.stack([log_q + math.log(b), log_pi + math.log1p(-b)]), dim=0)
        value = b * kl_rows(log_q, log_m) + (1.0 - b) * kl_rows(log_pi, log_m)
        if norm:
            value = value / (b * (1.0 - b))
    return _scatter(value, mask)


# --------------------------------------------------------------------------------------------
# Mixture
# --------------------------------------------------------------------------------------------

GKD_TERMS: dict[str, tuple[str, Callable[..., Any]]] = {
    "k2": ("logprobs", k2),
    "k3": ("logprobs", k3),
    "topk_kl": ("topk", topk_kl),
    "full_kl": ("logits", full_kl),
    "jsd": ("logits", jsd),
}
"""GKD terms a mixture may use, with the ``KLSpec.requires`` level each needs."""


def pg_surrogate(inputs: KLInputs, *, clamp: float | None = None) -> "torch.Tensor":
    """The PG-style term in loss form: value ``d_t`` (detached), gradient ``d_t * grad log pi(y_t)``.

    Built as ``sg(d) + sg(d) * (log pi - sg(log pi))``: the value reads as the sampled reverse-KL
    estimate while the gradient is the REINFORCE gradient with per-token reward ``-d_t`` (what
    ``advantage -= d`` gives a vanilla policy-gradient loss, without clipping).
    """
    d, logp, mask = _log_diff("opd_pg_surrogate", inputs)
    adv = _finish("opd_pg_surrogate", d.detach(), mask, clamp)
    return adv + adv * (logp - logp.detach())


class MixTerm:
    """``pg_ratio * pg_surrogate + gkd_ratio * <gkd term>`` as one differentiable loss term.

    One instance is registered per ``KLSpec.requires`` level (``opd_mix`` = logprobs,
    ``opd_mix_topk`` = topk, ``opd_mix_logits`` = logits); ``gkd`` must be a term whose inputs that
    level provides. Job-file arguments: ``gkd`` (name, see :data:`GKD_TERMS`), ``pg_ratio``,
    ``gkd_ratio`` (non-negative weights, not required to sum to 1), ``gkd_args`` (a table passed
    to the GKD term), ``pg_clamp`` (bound on the PG value).
    """

    ALLOWED = {"logprobs": ("k2", "k3"), "topk": ("k2", "k3", "topk_kl"),
               "logits": ("k2", "k3", "full_kl", "jsd")}
    DEFAULT_GKD = {"logprobs": "k3", "topk": "topk_kl", "logits": "full_kl"}

    def __init__(self, requires: str) -> None:
        if requires not in self.ALLOWED:
            raise ValueError(f"MixTerm: requires must be one of {list(self.ALLOWED)}, got {requires!r}")
        self.requires = requires
        self.name = "opd_mix" if requires == "logprobs" else f"opd_mix_{requires}"
        self.__name__ = self.name

    def __call__(self, inputs: KLInputs, *, gkd: str | None = None, pg_ratio: float = 0.5,
                 gkd_ratio: float = 0.5, gkd_args: dict[str, Any] | None = None,
                 pg_clamp: float | None = None) -> "torch.Tensor":
        owner = self.name
        term = self.DEFAULT_GKD[self.requires] if gkd is None else gkd
        term = chk.choice(owner, "gkd", term, self.ALLOWED[self.requires])
        a = chk.number(owner, "pg_ratio", pg_ratio, low=0.0)
        b = chk.number(owner, "gkd_ratio", gkd_ratio, low=0.0)
        if gkd_args is not None and not isinstance(gkd_args, dict):
            raise TypeError(f"{owner}: argument 'gkd_args' must be a table of arguments for {term!r}, "
                            f"got {gkd_args!r}")
        gkd_value = GKD_TERMS[term][1](inputs, **(gkd_args or {}))
        pg_value = pg_surrogate(inputs, clamp=pg_clamp)
        return a * pg_value.to(gkd_value.dtype) + b * gkd_value
