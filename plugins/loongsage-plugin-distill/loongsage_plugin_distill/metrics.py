"""Distillation metrics: how far the student is from the teacher, as masked token means.

:func:`distill_metrics` reads a :class:`~loongsage_hookspecs.KLInputs` (the same record the
distillation terms receive) and reports what its filled fields allow:

* ``train/opd_kl``: ``log pi(y) - log q(y)``, the sampled reverse-KL estimate (always).
* ``train/opd_topk_overlap_ratio``: 1 if the sampled token is in the teacher's top-k, else 0
  (needs ``input_ids`` and the teacher top-k).
* ``train/opd_topk_set_overlap``: ``|topk(pi) & topk(q)| / k`` (needs student ``logits`` and the
  teacher top-k).
* ``train/opd_teacher_entropy``: teacher entropy ``H(q)`` (needs ``ref_logits`` or the teacher top-k).
* ``train/opd_entropy_gap``: ``H(pi) - H(q)``, student minus teacher (needs student ``logits`` too).

"Teacher top-k" is ``ref_topk_ids`` / ``ref_topk_logprobs`` or, without them, the top-k of
``ref_logits``. Entropies are exact over the vocabulary when ``ref_logits`` is present; with only
the teacher's top-k they are entropies of the ``k + 1``-bucket distributions (the k ids plus one
tail bucket) of both sides, a lower bound of the exact values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loongsage_hookspecs import KLInputs

from . import _checks as chk
from .terms import _scatter

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

PREFIX = "train/opd_"
DEFAULT_K = 16
"""Top-k size used for the overlap metrics when only ``ref_logits`` (no teacher top-k) is given."""


def _entropy(logp: "torch.Tensor") -> "torch.Tensor":
    import torch

    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def _bucket_logprobs(logp_support: "torch.Tensor") -> "torch.Tensor":
    """``[N, k]`` log-probs of the support plus a last column for the tail bucket."""
    import torch

    tail = (1.0 - logp_support.exp().sum(-1, keepdim=True)).clamp_min(0.0)
    return torch.cat([logp_support, torch.where(tail > 0, tail.log(), torch.full_like(tail, -float("inf")))], -1)


def distill_metrics(inputs: KLInputs, *, input_ids: "torch.Tensor | None" = None, k: int | None = None,
                    per_token: bool = False) -> dict[str, Any]:
    """Distillation metrics of one batch as ``{"train/opd_<name>": value}`` (see the module table).

    ``input_ids`` ``[B, T]`` are the sampled tokens (for the overlap ratio). ``k`` is the top-k size
    (default: every column of ``ref_topk_ids``, else :data:`DEFAULT_K`). Values are float masked
    means over ``response_mask``; with ``per_token = True`` they are detached ``[B, T]`` tensors (0
    off the mask) instead, for a host that accumulates masked means over micro-batches. A batch
    without trained tokens gives ``{}``.
    """
    import torch

    owner = "distill_metrics"
    if not isinstance(inputs, KLInputs):
        raise TypeError(f"{owner}: expected KLInputs, got {type(inputs).__name__}")
    mask = chk.mask_bool(owner, inputs.response_mask)
    logp = chk.token_tensor(owner, "logprobs", inputs.logprobs, mask).detach()
    ref = chk.token_tensor(owner, "ref_logprobs", inputs.ref_logprobs, mask).detach()
    count = int(mask.sum())
    if count == 0:
        return {}
    dtype = chk.compute_dtype(logp)
    dev = logp.device
    m = mask.to(dev)
    rows: dict[str, torch.Tensor] = {"kl": (logp[m] - ref.to(dev)[m]).to(dtype)}

    with torch.no_grad():
        student = None
        if inputs.logits is not None:
            student = chk.vocab_tensor(owner, "logits", inputs.logits, mask)[m].to(dtype)
        teacher_full = None
        if inputs.ref_logits is not None:
            teacher_full = torch.log_softmax(
                chk.vocab_tensor(owner, "ref_logits", inputs.ref_logits, mask)[m].to(device=dev, dtype=dtype), -1)

        ids = lq = None
        if inputs.ref_topk_ids is not None and inputs.ref_topk_logprobs is not None:
            ids = chk.vocab_tensor(owner, "ref_topk_ids", inputs.ref_topk_ids, mask, floating=False)[m].to(dev).long()
            lq = chk.vocab_tensor(owner, "ref_topk_logprobs", inputs.ref_topk_logprobs, mask)[m].to(dev, dtype)
            kk = ids.shape[-1] if k is None else chk.integer(owner, "k", k, low=1)
            if kk > ids.shape[-1]:
                raise ValueError(f"{owner}: argument 'k'={kk} exceeds the {ids.shape[-1]} teacher top-k entries")
            lq, pos = lq.topk(kk, dim=-1)
            ids = ids.gather(-1, pos)
        elif teacher_full is not None:
            kk = DEFAULT_K if k is None else chk.integer(owner, "k", k, low=1)
            kk = min(kk, teacher_full.shape[-1])
            lq, ids = teacher_full.topk(kk, dim=-1)

        if ids is not None:
            if input_ids is not None:
                sampled = input_ids.to(dev)
                if tuple(sampled.shape) != tuple(mask.shape):
                    raise ValueError(f"{owner}: input_ids has shape {tuple(sampled.shape)}, expected "
                                     f"{tuple(mask.shape)}")
                rows["topk_overlap_ratio"] = (ids == sampled[m].long().unsqueeze(-1)).any(-1).to(dtype)
            if student is not None:
                s_ids = student.topk(ids.shape[-1], dim=-1).indices
                common = (s_ids.unsqueeze(-1) == ids.unsqueeze(-2)).any(-1).sum(-1)
                rows["topk_set_overlap"] = common.to(dtype) / ids.shape[-1]

        if teacher_full is not None:
            h_teacher = _entropy(teacher_full)
            rows["teacher_entropy"] = h_teacher
            if student is not None:
                if student.shape[-1] != teacher_full.shape[-1]:
                    raise ValueError(f"{owner}: student logits have {student.shape[-1]} vocabulary entries, "
                                     f"teacher ref_logits {teacher_full.shape[-1]}")
                rows["entropy_gap"] = _entropy(torch.log_softmax(student, -1)) - h_teacher
        elif ids is not None and lq is not None:
            h_teacher = _entropy(_bucket_logprobs(lq))
            rows["teacher_entropy"] = h_teacher
            if student is not None:
                lp = torch.log_softmax(student, -1).gather(-1, ids)
                rows["entropy_gap"] = _entropy(_bucket_logprobs(lp)) - h_teacher

    out: dict[str, Any] = {}
    for name, values in rows.items():
        key = PREFIX + name
        out[key] = _scatter(values, m) if per_token else float(values.sum()) / count
    return out
