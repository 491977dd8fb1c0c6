"""Per-token log-probs, entropies and top-k log-probs aligned with the input tokens (position 0 holds 0)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


def logprobs_and_entropy(logits: "torch.Tensor", input_ids: "torch.Tensor", *,
                         entropy_grad: bool = True) -> "tuple[torch.Tensor, torch.Tensor]":
    """``[B, T]`` log-probs of ``input_ids`` and entropies from next-token ``logits`` ``[B, T-1, V]``.

    ``logsumexp`` plus a gather instead of a full ``log_softmax``; the entropy is
    ``lse - sum(softmax * logits)``, without autograd history unless ``entropy_grad``.
    """
    import torch
    import torch.nn.functional as F

    lse, picked = _sampled(logits, input_ids)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        src, lse_e = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
        entropy = lse_e - (torch.softmax(src, dim=-1) * src).sum(-1)
    return F.pad(picked, (1, 0)), F.pad(entropy, (1, 0))


def sampled_logprobs_and_topk(logits: "torch.Tensor", input_ids: "torch.Tensor", topk: int = 0
                              ) -> "tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]":
    """``[B, T]`` log-probs of ``input_ids`` from next-token ``logits`` ``[B, T-1, V]`` and, with
    ``topk`` > 0, the ``topk`` largest log-probs and their token ids ``[B, T, topk]`` (largest first).

    Entry ``t`` describes the distribution that produced token ``t`` (position 0 holds 0). The
    log-probs are ``logits - logsumexp(logits)``: a per-position shift, so the top k of the logits
    are the top k of the log-probs and no full ``log_softmax`` is materialised.
    """
    import torch.nn.functional as F

    lse, picked = _sampled(logits, input_ids)
    if not topk:
        return F.pad(picked, (1, 0)), None, None
    values, index = logits.topk(topk, dim=-1)
    return F.pad(picked, (1, 0)), F.pad(values - lse.unsqueeze(-1), (0, 0, 1, 0)), F.pad(index, (0, 0, 1, 0))



def _sampled(logits: "torch.Tensor", input_ids: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
    """``(logsumexp, log-prob of the next token)`` ``[B, T-1]`` from next-token ``logits`` ``[B, T-1, V]``."""
    import torch

    lse = torch.logsumexp(logits, dim=-1)
    return lse, logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - lse
