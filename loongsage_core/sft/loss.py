"""The supervised loss as loss-pipeline components, so a train backend's worker trains SFT unchanged.

A train backend builds its loss from ``[algorithm] policy_loss`` and ``loss_agg`` looked up in
the component registry it is given. SFT gives it a registry (:class:`SftComponents`) in which
the policy loss :data:`NLL_LOSS` is the per-token negative log-likelihood and the aggregation
:data:`TOKEN_MEAN` divides the masked sum by the step's number of loss tokens (over every
micro-batch and packed row), so the step loss is the mean NLL of the step's assistant tokens
however the rows are split or packed. The batch's ``advantages`` and ``old_logprobs`` (which the
pipeline requires of every batch) are zeros that this loss does not read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loongsage_hookspecs import AggregationNorm, AggregationSpec, PolicyLossInputs, PolicyLossOutput, PolicyLossSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

NLL_LOSS = "sft_nll"
TOKEN_MEAN = "sft_token_mean"


def nll_loss(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """Per-token negative log-likelihood of the target tokens (``-logprobs``)."""
    return PolicyLossOutput(loss=-inputs.logprobs)


def token_mean(loss: "torch.Tensor", mask: "torch.Tensor", norm: AggregationNorm) -> "torch.Tensor":
    """Masked sum over the global number of loss tokens of the step (``norm.num_tokens``)."""
    return (loss * mask).sum() / max(float(norm.num_tokens), 1.0)


SPECS: dict[tuple[str, str], Any] = {
    ("policy_loss", NLL_LOSS): PolicyLossSpec(name=NLL_LOSS, fn=nll_loss,
                                              description="supervised fine-tuning: token negative log-likelihood"),
    ("loss_aggregation", TOKEN_MEAN): AggregationSpec(name=TOKEN_MEAN, fn=token_mean,
                                                      description="mean over the step's loss tokens"),
}


class SftComponents:
    """The job's plugin registry plus the two SFT loss components (a ``ComponentRegistry``)."""

    def __init__(self, host: Any) -> None:
        self.host = host

    def get(self, kind: str, name: str, where: str | None = None) -> Any:
        spec = SPECS.get((kind, name))
        return spec if spec is not None else self.host.get(kind, name, where=where)

    def build(self, kind: str, name: str, ctx: Any, *, where: str | None = None, args_key: str | None = None,
              using: str = "factory", **args: Any) -> Any:
        # the two SFT losses are functions, never built: everything built comes from the host
        return self.host.build(kind, name, ctx, where=where, args_key=args_key, using=using, **args)

    def components(self, kind: str) -> dict[str, Any]:
        found = dict(self.host.components(kind))
        found.update({n: s for (k, n), s in SPECS.items() if k == kind})
        return found
