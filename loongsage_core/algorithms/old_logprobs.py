"""When the step needs a separate old-log-prob forward pass, and what stands in for it otherwise.

The policy loss compares the current log-probs with the *old* ones: those of the trainer's
weights at the start of the step (the proximal policy), whatever weight version generated the
samples. The controller normally runs a separate no-gradient forward over the step's rows for them.
That pass is redundant when the step makes **one optimizer pass**: the training forward runs with
exactly those weights (no update has happened yet when the one mini-batch's micro-batches are
scored), so its own detached log-probs *are* the old log-probs. TRL skips the pass in that case,
and so does LoongSage. Samples of older weights (an async run's stale groups, a partial rollout's
older prefix) change nothing here: the pass would score them with the same current weights; the
gap between the weights that drew them and the current ones is what the behaviour (rollout)
log-probs and the corrections that read them are for. The rule (:func:`old_logprob_pass`), in
one place:

the separate pass is skipped when all of these hold

* ``[algorithm] recompute_old_logprobs = true`` (otherwise there is no pass: old = rollout);
* ``[algorithm] force_old_logprob_pass = false`` (the switch that always runs it);
* no Router Replay comparison (``router_replay_compare`` with routed experts in the batch: the
  pass measures what replay changes);
* ``[train] ppo_epochs = 1`` and the step's rows fit in one mini-batch (``[train]
  mini_batch_size``): a second optimizer step would see updated weights;
* nothing needs the old log-probs *before* training: no pre-advantage correction (``tis``,
  ``m2po`` weigh old against rollout log-probs before the advantages), no KL or distillation
  term in the reward, no distillation teachers (their metrics compare against the old log-probs).

When it is skipped the rows carry :data:`OLD_LOGPROBS_SOURCE` = :data:`FROM_TRAINING_FORWARD` in
their meta and no ``old_logprobs`` tensor; :class:`~loongsage_core.algorithms.pipeline.LossPipeline`
then uses the micro-batch's own detached log-probs as old log-probs and reports the
train-inference gap (``train/is_approx_k3_kl``, ``train/logprob_abs_diff_mean`` / ``_max``) from
them, so those metrics mean the same thing in both cases. Post-forward corrections (``opsm``) see
the same old log-probs as with the pass. The step reports ``perf/old_logprob_pass_skipped``.
"""

from __future__ import annotations

from typing import Any

from loongsage_hookspecs import Batch

OLD_LOGPROBS_SOURCE = "old_logprobs_source"
"""Per-row meta key saying where the loss takes the old log-probs from when the batch has none."""

FROM_TRAINING_FORWARD = "training_forward"
"""Value of :data:`OLD_LOGPROBS_SOURCE`: the training forward's own detached log-probs."""


def compares_router_replay(job: Any, batch: Batch) -> bool:
    """Whether the old-log-prob pass also scores ``batch`` without Router Replay
    (``router_replay_compare``, for the ``*_no_replay`` metrics): only rows with recorded routes."""
    alg = job.algorithm
    return (bool(getattr(alg, "router_replay", False)) and bool(getattr(alg, "router_replay_compare", True))
            and "routed_experts" in batch)


def old_logprob_pass(job: Any, batch: Batch, *, needed_before_training: bool) -> tuple[bool, str]:
    """Whether the step must run the separate old-log-prob pass over ``batch``, and why.

    ``needed_before_training`` is true when
    something of the step reads the old log-probs before the optimizer pass (pre-advantage
    corrections, KL or distillation in the reward, teachers). Returns ``(run_the_pass, reason)``.
    """
    alg, train = job.algorithm, job.train
    if not alg.recompute_old_logprobs:
        return False, "recompute_old_logprobs is off (old = rollout log-probs)"
    if getattr(alg, "force_old_logprob_pass", False):
        return True, "force_old_logprob_pass is set"
    if compares_router_replay(job, batch):
        return True, "router_replay_compare: the pass also scores the rows without Router Replay"
    if int(train.ppo_epochs) != 1:
        return True, f"ppo_epochs = {train.ppo_epochs}: later passes see updated weights"
    if len(batch) > int(train.mini_batch_size):
        return True, (f"{len(batch)} rows make more than one mini-batch of {train.mini_batch_size}: later "
                      "mini-batches see updated weights")
    if needed_before_training:
        return True, ("the old log-probs are needed before training (pre-advantage corrections, KL in the "
                      "reward, teachers)")
    return False, "one optimizer pass: the training forward scores with the step's starting weights"


def mark_old_from_training_forward(batch: Batch) -> None:
    """Tell the loss to take the old log-probs from the training forward (rule: :func:`old_logprob_pass`)."""
    batch.tensors.pop("old_logprobs", None)
    batch.meta[OLD_LOGPROBS_SOURCE] = [FROM_TRAINING_FORWARD] * len(batch)


def old_from_training_forward(batch: Batch) -> bool:
    """Whether ``batch``'s rows take their old log-probs from the training forward."""
    source = batch.meta.get(OLD_LOGPROBS_SOURCE)
    if not source:
        return False
    return all(s == FROM_TRAINING_FORWARD for s in source)


__all__ = ["FROM_TRAINING_FORWARD", "OLD_LOGPROBS_SOURCE", "mark_old_from_training_forward",
           "old_from_training_forward", "old_logprob_pass"]
