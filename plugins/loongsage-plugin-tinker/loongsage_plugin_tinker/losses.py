"""The Tinker SDK's built-in losses as LoongSage loss components.

The service trains through the train backend's own loss pipeline: each Tinker ``loss_fn`` is a
policy loss here, and the aggregation is a plain sum, as Tinker defines its losses (a sum over
every datum's tokens, never a mean). The per-token coefficient of each loss travels in the batch's
``advantages`` (for ``cross_entropy`` the datum's ``weights``, for the policy-gradient losses its
``advantages``) and the log-probs the samples were drawn with in ``old_logprobs``:

* ``cross_entropy``: ``-weights * logp``;
* ``importance_sampling``: ``-exp(logp - sampling_logp) * advantages``;
* ``ppo``: ``-min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)`` with
  ``r = exp(logp - sampling_logp)`` (thresholds on the ratio itself, 0.8 and 1.2 by default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loongsage_hookspecs import AggregationNorm, AggregationSpec, PolicyLossInputs, PolicyLossOutput, PolicyLossSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

SUM = "tinker_sum"
"""The aggregation every Tinker loss uses: the masked sum of the per-token loss."""

LOSSES = {"cross_entropy": "tinker_cross_entropy", "importance_sampling": "tinker_importance_sampling",
          "ppo": "tinker_ppo"}
"""Tinker ``loss_fn`` name -> the policy-loss component that computes it."""

LOSS_CONFIG_KEYS = {"cross_entropy": (), "importance_sampling": (),
                    "ppo": ("clip_low_threshold", "clip_high_threshold")}
"""The ``loss_fn_config`` keys each loss accepts."""


def cross_entropy(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """Weighted negative log-likelihood of the target tokens (weights in ``advantages``)."""
    return PolicyLossOutput(loss=-inputs.advantages * inputs.logprobs)


def importance_sampling(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """REINFORCE with the importance ratio to the sampling policy, unclipped."""
    import torch

    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    return PolicyLossOutput(loss=-ratio * inputs.advantages, metrics={"ratio": ratio.detach()})


def ppo(inputs: PolicyLossInputs, *, clip_low_threshold: float = 0.8,
        clip_high_threshold: float = 1.2) -> PolicyLossOutput:
    """The clipped PPO objective, with Tinker's ratio bounds."""
    import torch

    if not 0.0 <= float(clip_low_threshold) <= 1.0 <= float(clip_high_threshold):
        raise ValueError(f"ppo: loss_fn_config needs clip_low_threshold <= 1 <= clip_high_threshold, got "
                         f"{clip_low_threshold} and {clip_high_threshold}")
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    clipped = torch.clamp(ratio, float(clip_low_threshold), float(clip_high_threshold))
    objective = torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    return PolicyLossOutput(loss=-objective, metrics={"clip_fraction": (clipped != ratio).float()})


def token_sum(loss: "torch.Tensor", mask: "torch.Tensor", norm: AggregationNorm) -> "torch.Tensor":
    """The masked sum (Tinker's losses are sums over tokens, whatever the batch's size)."""
    return (loss * mask).sum()


SPECS: tuple[Any, ...] = (
    PolicyLossSpec(name=LOSSES["cross_entropy"], fn=cross_entropy,
                   description="Tinker cross_entropy: -weights * logp (weights in advantages)"),
    PolicyLossSpec(name=LOSSES["importance_sampling"], fn=importance_sampling,
                   description="Tinker importance_sampling: -exp(logp - sampling logp) * advantages"),
    PolicyLossSpec(name=LOSSES["ppo"], fn=ppo, description="Tinker ppo: clipped ratio objective, ratio bounds"),
    AggregationSpec(name=SUM, fn=token_sum, description="Tinker: the masked sum over tokens"),
)
