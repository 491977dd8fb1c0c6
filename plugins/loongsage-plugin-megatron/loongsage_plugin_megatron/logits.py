"""Per-token log-probs and entropies aligned with the input tokens (position 0 holds 0)."""

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

    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - lse
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        src, lse_e = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
        entropy = lse_e - (torch.softmax(src, dim=-1) * src).sum(-1)
    return F.pad(picked, (1, 0)), F.pad(entropy, (1, 0))
