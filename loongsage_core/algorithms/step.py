"""The step's algorithm (docs/guide/algorithms.md), once per step and in one place.

After the controller has put a step's rows into one :class:`Batch` with the log-probs the loss
needs (``rollout_logprobs``, ``old_logprobs``, ``ref_logprobs`` when a reference model runs,
the teachers' tensors when sources distil, ``values`` when a critic runs),
:meth:`StepAlgorithm.prepare` runs, in order::

    pre-advantage corrections (M2PO mask, IS weights vs the rollout log-probs)
        -> batch["correction_weights"], batch["correction_mask"]
    token rewards: - kl_coef * KL(old || ref)            ([algorithm] kl_in_reward)
                   - coef * distillation term            (distill_in_reward, or kl_in_reward when
                                                           the teachers stand in for the reference)
    advantages (and returns) from the rewards, the token rewards, the group and sample indices
        -> batch["advantages"], batch["returns"]
    step metrics: the train-inference gap ``train/is_approx_k3_kl`` (once, over the step's rows),
                  advantage statistics, the corrections' and the penalties' means

and :meth:`StepAlgorithm.mini_batches` cuts the rows into mini-batches, each with the one
:class:`AggregationNorm` (global denominators) that the policy and the critic both train with.
What is left per micro-batch (current log-probs -> post-forward corrections -> policy loss x
masks x weights -> aggregation -> + KL / distillation / entropy terms) is
:class:`~loongsage_core.algorithms.pipeline.LossPipeline`, inside the train backends: they never
need to know this order.

Token rewards hold only the penalties: the sequence score stays in ``rewards``; token-level
estimators (``reinforce_pp``, ``gae``) add the penalties on their tokens, sequence-level ones
(``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp_baseline``) add their sum to the trajectory's
score (as verl does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from loongsage_hookspecs import (
    AdvantageInputs,
    AdvantageOutput,
    AggregationNorm,
    Batch,
    ComponentRegistry,
    CorrectionInputs,
    KLInputs,
)

from ..config import refs_by_field
from .norm import compute_norm
from .pipeline import (
    CORRECTION_MASK_KEY,
    CORRECTION_WEIGHTS_KEY,
    TEACHER_MASK_KEY,
    LossPipelineError,
    check_correction,
    combine_corrections,
    mean_metric,
    require,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch


class StepAlgorithm:
    """Everything of the loss pipeline that runs once per step, on all of the step's rows.

    Build it for a job with :meth:`from_job`; the constructor takes the bound components
    themselves (``BoundFunction`` values of :mod:`loongsage_core.binding`): the ``advantage``
    estimator, the ``pre_corrections`` (job-file order), ``kl`` the KL to the reference folded
    into the token rewards with ``kl_coef`` (``None``: none), and ``distill_term`` the
    distillation term folded into them, with ``distill`` the job's setup
    (:class:`.distill.DistillSetup`: ``coef``, ``key(field)``).
    """

    def __init__(self, *, advantage: Any, pre_corrections: Sequence[Any] = (), kl: Any = None,
                 kl_coef: float = 0.0, distill: Any = None, distill_term: Any = None) -> None:
        self.advantage = advantage
        self.pre_corrections = list(pre_corrections)
        self.kl = kl
        self.kl_coef = float(kl_coef)
        if (distill is None) != (distill_term is None):
            raise ValueError("StepAlgorithm: distill and distill_term come together")
        self.distill = distill
        self.distill_term = distill_term

    @classmethod
    def from_job(cls, job: Any, components: ComponentRegistry, *, distill: Any = None) -> "StepAlgorithm":
        """The step algorithm of ``job``'s ``[algorithm]`` table, its components bound through
        ``components``; ``distill``: the job's distillation setup (``DistillSetup``) or ``None``."""
        alg = job.algorithm
        refs = refs_by_field(alg, "algorithm", job)
        corrections = [components.bind(r) for r in refs.get("corrections", [])]
        teachers_feed_kl = distill is not None and not distill.separate
        # KL to the frozen reference model in the reward (the teachers feed it when they stand in
        # for the reference: that is the distillation penalty below)
        in_reward = "kl" in refs and alg.kl_in_reward and alg.kl_coef != 0.0 and not teachers_feed_kl
        folded = distill if distill is not None and distill.in_reward else None
        return cls(advantage=components.bind(refs["advantage"][0]),
                   pre_corrections=[c for c in corrections if c.spec.stage == "pre_advantage"],
                   kl=components.bind(refs["kl"][0]) if in_reward else None, kl_coef=alg.kl_coef,
                   distill=folded, distill_term=components.bind(folded.ref) if folded is not None else None)

    @property
    def needs_old_logprobs_before_training(self) -> bool:
        """Whether :meth:`prepare` reads the old log-probs (pre-advantage corrections, KL or
        distillation in the reward): then the separate old-log-prob pass cannot be skipped."""
        return bool(self.pre_corrections) or self.kl is not None or self.distill is not None

    # -- once per step ---------------------------------------------------------------------------

    def prepare(self, batch: Batch) -> dict[str, float]:
        """Corrections, token rewards, advantages and returns into ``batch``; the step's metrics."""
        if len(batch) == 0:
            return {}
        metrics = self.correct(batch)
        penalty, penalty_metrics = self.token_penalties(batch)
        metrics.update(penalty_metrics)
        self.advantages(batch, penalty)
        metrics.update(advantage_metrics(batch))
        metrics.update(train_inference_gap(batch))
        return metrics

    def correct(self, batch: Batch) -> dict[str, float]:
        """Run the pre-advantage corrections (job-file order) on the step's rows.

        Stores the product of their weights and masks under :data:`CORRECTION_WEIGHTS_KEY` /
        :data:`CORRECTION_MASK_KEY` (they travel with the rows into the micro-batches, where
        :class:`LossPipeline` applies them) and returns their metrics as ``train/<name>``.
        """
        import torch

        if not self.pre_corrections:
            return {}
        mask = require(batch, "loss_mask").to(torch.float32)
        rollout = require(batch, "rollout_logprobs", "the off-policy corrections compare against it").float()
        old = batch.get("old_logprobs")
        old = rollout if old is None else old.float()
        weights = torch.ones_like(mask)
        keep = torch.ones_like(mask)
        metrics: dict[str, float] = {}
        for correction in self.pre_corrections:
            inputs = CorrectionInputs(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask * keep)
            out = check_correction(correction.name, correction(inputs), mask.shape)
            weights, keep = combine_corrections(weights, keep, out)
            for key, value in out.metrics.items():
                metrics[f"train/{key}"] = mean_metric(value, mask)
        batch.tensors[CORRECTION_WEIGHTS_KEY] = weights.detach()
        batch.tensors[CORRECTION_MASK_KEY] = keep.detach()
        metrics["train/correction_kept_ratio"] = mean_metric(keep, mask)
        return metrics

    def token_penalties(self, batch: Batch) -> "tuple[torch.Tensor | None, dict[str, float]]":
        """``[B, T]`` penalties folded into the token rewards (negative; 0 off the trained tokens),
        or ``None`` when nothing goes into the reward; and their ``train/*`` means."""
        mask = require(batch, "loss_mask").float()
        total: torch.Tensor | None = None
        metrics: dict[str, float] = {}
        if self.kl is not None:
            inputs = KLInputs(logprobs=require(batch, "old_logprobs", "the KL in the reward is of the policy").float(),
                              ref_logprobs=require(batch, "ref_logprobs", "the KL in the reward compares against "
                                                   "the reference model").float(), response_mask=mask)
            kl = self._per_token("kl", self.kl, self.kl(inputs), mask)
            total = -self.kl_coef * kl
            metrics["train/reward_kl"] = mean_metric(kl, mask)
        if self.distill is not None:
            term_mask = mask * require(batch, TEACHER_MASK_KEY, "the teachers' pass fills it").float()
            inputs = KLInputs(logprobs=require(batch, "old_logprobs").float(),
                              ref_logprobs=require(batch, self.distill.key("logprobs")).float(),
                              response_mask=term_mask)
            term = self._per_token("distillation term", self.distill_term, self.distill_term(inputs), term_mask)
            penalty = float(self.distill.coef) * term
            total = -penalty if total is None else total - penalty
            if bool((term_mask > 0).any()):
                metrics["train/reward_distill"] = mean_metric(term, term_mask)
        return total, metrics

    def advantages(self, batch: Batch, token_rewards: "torch.Tensor | None" = None) -> None:
        """Advantages ``[B, T]`` (0 off the trained tokens) and, from estimators that give them,
        ``returns`` into ``batch``. Tokens a pre-advantage correction masked are not trained
        tokens for the estimator either."""
        mask = require(batch, "loss_mask")
        if CORRECTION_MASK_KEY in batch:
            mask = mask * batch[CORRECTION_MASK_KEY].to(mask.dtype)
        out = self.advantage(AdvantageInputs(rewards=require(batch, "rewards"), response_mask=mask,
                                             group_index=require(batch, "group_index"),
                                             sample_index=batch.get("sample_index"),
                                             token_rewards=token_rewards, values=batch.get("values")))
        if not isinstance(out, AdvantageOutput):
            raise LossPipelineError(f"advantage {self.advantage.name!r} returned {type(out).__name__}, "
                                    "expected AdvantageOutput")
        if tuple(out.advantages.shape) != tuple(mask.shape):
            raise LossPipelineError(f"advantage {self.advantage.name!r} returned shape {tuple(out.advantages.shape)}, "
                                    f"expected per token {tuple(mask.shape)}")
        batch.tensors["advantages"] = out.advantages.float() * batch["loss_mask"].float()
        if out.returns is not None:
            batch.tensors["returns"] = out.returns.float()

    # -- mini-batches ----------------------------------------------------------------------------

    def mini_batches(self, batch: Batch, order: Sequence[int], size: int) -> Iterator[tuple[Batch, AggregationNorm]]:
        """Consecutive mini-batches of ``size`` rows in ``order``, each with its norm; a mini-batch
        without a trained token is skipped (it has nothing to learn from)."""
        for rows, norm in self.mini_batch_rows(batch, order, size):
            yield batch.select(rows), norm

    def mini_batch_rows(self, batch: Batch, order: Sequence[int],
                        size: int) -> Iterator[tuple[list[int], AggregationNorm]]:
        """:meth:`mini_batches` as row indices of ``batch`` (what a worker group ships to the ranks)."""
        for start in range(0, len(order), size):
            rows = [int(i) for i in order[start:start + size]]
            mini = batch.select(rows)
            if float(mini["loss_mask"].sum()) == 0.0:
                continue
            yield rows, compute_norm(mini)  # the global denominators, before the mini-batch is sharded

    @staticmethod
    def _per_token(what: str, term: Any, value: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
        import torch

        if tuple(value.shape) != tuple(mask.shape):
            raise LossPipelineError(f"{what} {term.name!r} returned shape {tuple(value.shape)}, expected per-token "
                                    f"{tuple(mask.shape)}")
        return torch.where(mask > 0, value.detach().float(), torch.zeros_like(mask, dtype=torch.float32))


def train_inference_gap(batch: Batch) -> dict[str, float]:
    """Gap between the trainer's old log-probs and the engine's rollout log-probs on the same tokens.

    ``train/is_approx_k3_kl`` is the masked mean of ``exp(r) - r - 1`` with
    ``r = logp_old - logp_rollout`` (docs/reference/metrics.md), in float64 with ``expm1`` (in fp32,
    ``exp(r) - r - 1`` cancels catastrophically for the tiny ``r`` of a consistent trainer and
    engine).
    """

    if "old_logprobs" not in batch or "rollout_logprobs" not in batch:
        return {}
    return _logprob_gap(batch, batch["old_logprobs"])


def _logprob_gap(batch: Batch, logprobs: "torch.Tensor", suffix: str = "") -> dict[str, float]:
    """The k3 gap and absolute log-prob differences of ``logprobs`` against the rollout's, over
    the loss mask (see :func:`train_inference_gap`); names end with ``suffix``."""
    import torch

    mask = batch["loss_mask"] > 0
    if not bool(mask.any()):
        return {}
    r = (logprobs - batch["rollout_logprobs"]).double()[mask]
    k3 = torch.expm1(r) - r
    diff = r.abs()
    return {
        f"train/is_approx_k3_kl{suffix}": float(k3.mean()),
        f"train/logprob_abs_diff_mean{suffix}": float(diff.mean()),
        f"train/logprob_abs_diff_max{suffix}": float(diff.max()),
    }


ROUTER_REPLAY_OUTPUTS = ("router_agreement", "logprobs_no_replay", "router_agreement_no_replay")
"""What a policy's old-log-prob pass returns besides ``logprobs`` under Router Replay's comparison."""


def router_replay_metrics(batch: Batch, outputs: Mapping[str, "torch.Tensor"]) -> dict[str, float]:
    """What Router Replay buys, from the old-log-prob pass's :data:`ROUTER_REPLAY_OUTPUTS`:
    ``train/router_agreement`` (with replay: 1.0 unless the records do not line up with the
    tokens) and ``train/router_agreement_no_replay`` (the trainer's own routing), the share of
    token-layer choices where the experts the trainer used are the engine's, over every token
    with a record; and the train-inference gap of the pass without replay,
    ``train/is_approx_k3_kl_no_replay`` (and ``train/logprob_abs_diff_*_no_replay``), to set
    against ``train/is_approx_k3_kl``."""
    real = batch["attention_mask"] > 0
    out: dict[str, float] = {}
    for key in ("router_agreement", "router_agreement_no_replay"):
        if key in outputs:
            values = outputs[key]
            measured = real & (values >= 0)
            if bool(measured.any()):
                out[f"train/{key}"] = float(values[measured].double().mean())
    if "logprobs_no_replay" in outputs and "rollout_logprobs" in batch:
        out.update(_logprob_gap(batch, outputs["logprobs_no_replay"], "_no_replay"))
    return out


def advantage_metrics(batch: Batch) -> dict[str, float]:
    """``train/adv_*``: mean, mean absolute value and share of zeros over the trained tokens."""
    mask = batch["loss_mask"] > 0
    if not bool(mask.any()):
        return {}
    adv = batch["advantages"][mask]
    return {
        "train/adv_mean": float(adv.mean()),
        "train/adv_abs_mean": float(adv.abs().mean()),
        "train/adv_zero_ratio": float((adv == 0).float().mean()),
    }


__all__ = ["StepAlgorithm", "advantage_metrics", "train_inference_gap"]
