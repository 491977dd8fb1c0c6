"""The supervised loss as loss-pipeline components, so a train backend's worker trains SFT unchanged.

A train backend builds its loss from ``[algorithm] policy_loss`` and ``loss_agg``, bound through
the component registry it is given. SFT registers two components in the run's plugin host and
names them in the trainer's ``[algorithm]``: the policy loss :data:`NLL_LOSS` is the per-token
negative log-likelihood and the aggregation :data:`TOKEN_MEAN` divides the masked sum by the
step's number of loss tokens (over every micro-batch and packed row), so the step loss is the
mean NLL of the step's assistant tokens however the rows are split or packed. The batch's
``advantages`` and ``old_logprobs`` (which the pipeline requires of every batch) are zeros that
this loss does not read.
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


SPECS: tuple[Any, ...] = (
    PolicyLossSpec(name=NLL_LOSS, fn=nll_loss, description="supervised fine-tuning: token negative log-likelihood"),
    AggregationSpec(name=TOKEN_MEAN, fn=token_mean, description="mean over the step's loss tokens"),
)
"""The two SFT loss components, provided to the run's plugin host as one more plugin
(:func:`provide_sft_losses`)."""

SFT_PLUGIN = "module:sft"


def provide_sft_losses(host: Any) -> None:
    """Make :data:`NLL_LOSS` and :data:`TOKEN_MEAN` selectable in ``host`` (a
    :class:`~loongsage_core.plugins.PluginHost`), as a hookimpl module would; doing it again is harmless."""
    if not host.pm.has_plugin(SFT_PLUGIN):
        host.register_specs(*SPECS, name=SFT_PLUGIN)
