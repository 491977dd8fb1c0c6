"""Hook implementations of loongsage-plugin-rl (the module its entry point names).

Each hook only lists specs; the code lives in the modules beside this one. None of them imports
torch at import time, so importing this module and listing its components stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterator

from loongsage_hookspecs import (
    AdvantageSpec,
    AggregationSpec,
    CorrectionSpec,
    FilterSpec,
    KLSpec,
    PolicyLossSpec,
    RewardSpec,
    hookimpl,
)

from . import advantages, aggregation, corrections, filters, kl, policy_losses, reward_shaping


@hookimpl
def loongsage_advantages() -> Iterator[AdvantageSpec]:
    yield AdvantageSpec(name="grpo", fn=advantages.grpo, group_relative=True,
                        description="group-relative: (r - group mean) / (group std + eps); args norm_std, eps")
    yield AdvantageSpec(name="dr_grpo", fn=advantages.dr_grpo, group_relative=True,
                        description="Dr. GRPO: r - group mean, no std normalisation")
    yield AdvantageSpec(name="rloo", fn=advantages.rloo, group_relative=True,
                        description="REINFORCE leave-one-out: r - mean of the other rows of the group")
    yield AdvantageSpec(name="reinforce_pp", fn=advantages.reinforce_pp,
                        description="REINFORCE++: discounted token returns, batch-whitened; args gamma, whiten")
    yield AdvantageSpec(name="reinforce_pp_baseline", fn=advantages.reinforce_pp_baseline, group_relative=True,
                        description="REINFORCE++ with group-mean baseline, batch-whitened; args whiten")
    yield AdvantageSpec(name="gae", fn=advantages.gae, needs_critic=True,
                        description="generalised advantage estimation with a critic; args gamma, lam, whiten")


@hookimpl
def loongsage_policy_losses() -> Iterator[PolicyLossSpec]:
    yield PolicyLossSpec(name="ppo_clip", fn=policy_losses.ppo_clip,
                         description="PPO clipped surrogate; args clip_low, clip_high (clip-higher), dual_clip")
    yield PolicyLossSpec(name="gspo", fn=policy_losses.gspo,
                         description="GSPO sequence-level ratio, token form; args clip_low, clip_high")
    yield PolicyLossSpec(name="cispo", fn=policy_losses.cispo,
                         description="CISPO: clipped stop-gradient IS weight * A * logp; args clip_low, clip_high")
    yield PolicyLossSpec(name="reinforce", fn=policy_losses.reinforce,
                         description="vanilla policy gradient -A * logp")


@hookimpl
def loongsage_kls() -> Iterator[KLSpec]:
    yield KLSpec(name="k1", fn=kl.k1, description="logp - ref; arg clamp")
    yield KLSpec(name="k2", fn=kl.k2, description="(logp - ref)^2 / 2; arg clamp")
    yield KLSpec(name="k3", fn=kl.k3, description="exp(ref - logp) - (ref - logp) - 1; args clamp, log_ratio_clamp")
    yield KLSpec(name="low_var_kl", fn=kl.low_var_kl,
                 description="k3 with its value clamped to [-10, 10]; args clamp, log_ratio_clamp")


@hookimpl
def loongsage_loss_aggregations() -> Iterator[AggregationSpec]:
    yield AggregationSpec(name="token_mean", fn=aggregation.token_mean,
                          description="sum(loss * mask) / global token count")
    yield AggregationSpec(name="seq_mean_token_sum", fn=aggregation.seq_mean_token_sum,
                          description="per-row token sums, averaged over the global row count")
    yield AggregationSpec(name="seq_mean_token_mean", fn=aggregation.seq_mean_token_mean,
                          description="per-row token means, averaged over the global row count")
    yield AggregationSpec(name="seq_mean_token_sum_norm", fn=aggregation.seq_mean_token_sum_norm,
                          description="Dr. GRPO: sum(loss * mask) / (global rows * max_len); arg max_len")


@hookimpl
def loongsage_corrections() -> Iterator[CorrectionSpec]:
    yield CorrectionSpec(name="tis", fn=corrections.tis, stage="pre_advantage",
                         description="IS against rollout log-probs; args level (token/sequence/geometric), "
                                     "mode (clip/mask), lower, upper")
    yield CorrectionSpec(name="m2po", fn=corrections.m2po, stage="pre_advantage",
                         description="M2PO: mask largest (old - rollout)^2 tokens until mean <= tau; arg tau")
    yield CorrectionSpec(name="opsm", fn=corrections.opsm, stage="post_forward",
                         description="mask negative-advantage rows whose sequence KL > delta; args delta, behavior")


@hookimpl
def loongsage_filters() -> Iterator[FilterSpec]:
    yield FilterSpec(name="dynamic_sampling", fn=filters.dynamic_sampling,
                     description="DAPO: drop groups whose scores are all equal; arg min_spread")
    yield FilterSpec(name="overlong", fn=filters.overlong,
                     description="drop truncated (finish_reason length) trajectories or groups; arg mode")
    yield FilterSpec(name="status", fn=filters.status,
                     description="drop failed/aborted trajectories and groups left empty")


@hookimpl
def loongsage_rewards() -> Iterator[RewardSpec]:
    yield RewardSpec(name="overlong_penalty", fn=reward_shaping.overlong_penalty,
                     description="DAPO soft overlong punishment, 0 to -1; args max_len, cache_len, factor")
