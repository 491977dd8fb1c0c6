"""An example user hookimpl module: a custom reward and a custom advantage estimator.

A job file loads it by path (``configs/examples/custom_components.toml``: ``[plugins] modules =
["my_hooks.py"]``, a symlink there to this file) and selects its components by name, exactly like
components from installed plugins::

    [algorithm]
    advantage = "centered_clipped"
    advantage_args = { clip = 2.0 }

    [[data]]
    reward = ["brevity_bonus"]
"""

from __future__ import annotations

from typing import Any

from loongsage_hookspecs import AdvantageInputs, AdvantageOutput, AdvantageSpec, Reward, RewardSpec, hookimpl


def brevity_bonus(trajectory: Any, target_tokens: int = 16, weight: float = 0.1) -> Reward:
    """Reward short answers: ``weight`` at or under ``target_tokens`` response tokens, less beyond."""
    n = trajectory.response_length
    score = weight if n <= target_tokens else weight * target_tokens / n
    return Reward(score=score, details={"response_tokens": float(n)})


def centered_clipped(inputs: AdvantageInputs, clip: float = 1.0) -> AdvantageOutput:
    """Reward minus the mean reward of its group, clipped to ``[-clip, clip]``, on every response token."""
    import torch

    rewards = inputs.rewards.double()
    groups = inputs.group_index
    means = torch.zeros_like(rewards)
    for g in groups.unique():
        sel = groups == g
        means[sel] = rewards[sel].mean()
    adv = (rewards - means).clamp(-clip, clip).to(inputs.response_mask.dtype)
    return AdvantageOutput(advantages=adv[:, None] * inputs.response_mask)


@hookimpl
def loongsage_rewards():
    yield RewardSpec(name="brevity_bonus", fn=brevity_bonus, description="small bonus for short answers")


@hookimpl
def loongsage_advantages():
    yield AdvantageSpec(name="centered_clipped", fn=centered_clipped,
                        description="group-centred reward, clipped, no std normalisation")
