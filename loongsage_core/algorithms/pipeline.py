"""The per-micro-batch loss (docs/guide/algorithms.md), composed from named components.

What runs once per step on all of its rows (pre-advantage corrections, token rewards, advantages,
the aggregation denominators, the train-inference gap) is
:class:`~loongsage_core.algorithms.step.StepAlgorithm`, called by the controller. Order here (per
micro-batch, after the trainer's forward pass)::

    pre_advantage weights / masks (the step's, from the batch)
    post_forward corrections (see current log-probs)        -> more weights / masks
    policy loss per token -> x masks x IS weights -> aggregation (global norm)
    + kl_coef * aggregated KL to the reference   (when [algorithm] kl is set and not in the reward)
    + distill_coef * aggregated distillation term (when [algorithm] distill_kl is set, not in the reward)
    - entropy_coef * aggregated entropy

Components are bound from the job's ``[algorithm]`` table (names and ``*_args``) through the
backend's component registry (:meth:`LossPipeline.from_job`), the one way anything a job names
becomes callable (:mod:`loongsage_core.binding`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from loongsage_hookspecs import (
    AggregationNorm,
    Batch,
    ComponentRegistry,
    CorrectionInputs,
    CorrectionOutput,
    KLInputs,
    PolicyLossInputs,
    PolicyLossOutput,
)

from ..config import refs_by_field
from .metrics import Maximum
from .old_logprobs import old_from_training_forward

if TYPE_CHECKING:  # pragma: no cover
    import torch

CORRECTION_WEIGHTS_KEY = "correction_weights"
"""Batch tensor ``[B, T]`` holding the product of the pre-advantage corrections' weights."""

CORRECTION_MASK_KEY = "correction_mask"
"""Batch tensor ``[B, T]`` holding the product of the pre-advantage corrections' masks."""

TEACHER_MASK_KEY = "teacher_mask"
"""Batch tensor ``[B, T]``: 1 on rows whose data source has a distillation teacher, 0 elsewhere.
Multiplies the mask of the term the teachers feed (``kl`` without ``distill_kl``, else
``distill_kl``); a micro-batch without such rows skips that term."""


class LossPipelineError(ValueError):
    """The batch or the configuration cannot be run through the loss pipeline; says what is missing."""


class LossPipeline:
    """Per-micro-batch loss of one job, from its ``[algorithm]`` components, bound.

    ``loss(micro, logprobs, entropy, norm)`` returns the scalar micro-batch loss (already divided by the global
    ``norm``, so the sum over micro-batches and ranks is the mini-batch loss) and its metrics.
    Build it for a job with :meth:`from_job`; the constructor takes the bound components
    themselves (``BoundFunction`` values of :mod:`loongsage_core.binding`): ``policy_loss`` and
    ``aggregation``; ``corrections`` in job-file order (each runs at its spec's ``stage``);
    ``kl`` the KL to the reference in the loss (``None``: none), weighed by ``kl_coef``;
    ``distill`` the distillation term in the loss, weighed by ``distill_coef``; ``entropy_coef``
    the entropy bonus.
    """

    def __init__(self, *, policy_loss: Any, aggregation: Any, corrections: Sequence[Any] = (), kl: Any = None,
                 kl_coef: float = 0.0, distill: Any = None, distill_coef: float = 0.0,
                 entropy_coef: float = 0.0) -> None:
        self.policy_loss = policy_loss
        self.aggregation = aggregation
        self.kl = kl
        self.kl_coef = float(kl_coef)
        self.distill = distill
        self.distill_coef = float(distill_coef)
        self.entropy_coef = float(entropy_coef)
        self.corrections = list(corrections)
        self.pre_corrections = [c for c in self.corrections if c.spec.stage == "pre_advantage"]
        self.post_corrections = [c for c in self.corrections if c.spec.stage == "post_forward"]

    @classmethod
    def from_job(cls, job: Any, components: ComponentRegistry) -> "LossPipeline":
        """The loss of ``job``'s ``[algorithm]`` table, its components bound through
        ``components`` (a backend passes its context's registry)."""
        alg = job.algorithm
        refs = refs_by_field(alg, "algorithm", job)
        # a KL term in the loss; with kl_coef = 0 there is none (and no reference model runs)
        in_loss = "kl" in refs and not alg.kl_in_reward and float(alg.kl_coef) != 0.0
        distill = "distill_kl" in refs and not alg.distill_in_reward
        return cls(policy_loss=components.bind(refs["policy_loss"][0]),
                   aggregation=components.bind(refs["loss_agg"][0]),
                   corrections=[components.bind(r) for r in refs.get("corrections", [])],
                   kl=components.bind(refs["kl"][0]) if in_loss else None, kl_coef=alg.kl_coef,
                   distill=components.bind(refs["distill_kl"][0]) if distill else None,
                   distill_coef=alg.distill_coef, entropy_coef=alg.entropy_coef)

    # -- properties the trainer asks -------------------------------------------------------------

    @property
    def needs_ref_logprobs(self) -> bool:
        """Whether micro-batches must carry ``ref_logprobs`` (a KL to the reference is in the loss)."""
        return self.kl is not None

    @property
    def needs_logits(self) -> bool:
        """Whether :meth:`loss` needs the full logits (a vocabulary-level KL estimator)."""
        return any(t is not None and t.spec.requires != "logprobs" for t in (self.kl, self.distill))

    # -- per micro-batch -------------------------------------------------------------------------

    def loss(self, micro: Batch, logprobs: "torch.Tensor", entropy: "torch.Tensor | None",
             norm: AggregationNorm, *, logits: "torch.Tensor | None" = None,
             ) -> "tuple[torch.Tensor, dict[str, torch.Tensor]]":
        """The micro-batch loss and its metrics.

        ``logprobs`` / ``entropy`` ``[B, T]`` are the current policy's, with gradient, aligned with
        ``micro["input_ids"]``. Metrics are ``[B, T]`` tensors (reported as means over the loss
        mask) or 0-dim tensors (shares of a mini-batch total: ``loss``, ``pg_loss``, ``kl_loss``,
        ``entropy_loss``); feed them to :meth:`MetricAccumulator.add` with ``micro["loss_mask"]``.
        """
        import torch

        ids = require(micro, "input_ids")
        if tuple(logprobs.shape) != tuple(ids.shape):
            raise LossPipelineError(f"logprobs have shape {tuple(logprobs.shape)} but input_ids {tuple(ids.shape)}")
        dtype = logprobs.dtype
        mask = require(micro, "loss_mask").to(device=logprobs.device, dtype=dtype)
        advantages = _on(require(micro, "advantages"), logprobs)
        rollout = micro.get("rollout_logprobs")
        rollout = _on(rollout, logprobs) if rollout is not None else None
        old = micro.get("old_logprobs")
        gap_metrics: dict[str, Any] = {}
        if old is None and old_from_training_forward(micro):
            # one optimizer pass over samples of these weights: this forward's log-probs are the old ones
            old = logprobs.detach()
            if rollout is not None:
                gap_metrics = train_inference_gap_per_token(old, rollout, mask)
        elif old is None:
            if rollout is None:
                raise LossPipelineError("the batch has neither 'old_logprobs' nor 'rollout_logprobs'; the policy "
                                        "loss needs the log-probs the samples were drawn with")
            old = rollout
        old = _on(old, logprobs)

        weights = torch.ones_like(mask)
        keep = torch.ones_like(mask)
        if self.pre_corrections:
            if CORRECTION_WEIGHTS_KEY not in micro or CORRECTION_MASK_KEY not in micro:
                names = [c.name for c in self.pre_corrections]
                raise LossPipelineError(f"pre-advantage corrections {names} are configured but the batch has no "
                                        f"'{CORRECTION_WEIGHTS_KEY}'; StepAlgorithm.prepare(batch) computes it "
                                        "on the step's rows before training")
            weights = _on(micro[CORRECTION_WEIGHTS_KEY], logprobs)
            keep = _on(micro[CORRECTION_MASK_KEY], logprobs)

        metrics: dict[str, Any] = dict(gap_metrics)
        if self.post_corrections:
            if rollout is None:
                raise LossPipelineError("post-forward corrections need 'rollout_logprobs' in the batch")
            for correction in self.post_corrections:
                inputs = CorrectionInputs(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask * keep,
                                          advantages=advantages, logprobs=logprobs.detach())
                out = check_correction(correction.name, correction(inputs), mask.shape)
                weights, keep = combine_corrections(weights, keep, out)
                for key, value in out.metrics.items():
                    metrics[key] = _per_token_metric(value, mask)
        weights = weights.detach()
        train_mask = mask * keep.detach()

        out = self.policy_loss(PolicyLossInputs(logprobs=logprobs, old_logprobs=old, advantages=advantages,
                                                response_mask=train_mask, rollout_logprobs=rollout, weights=weights))
        if not isinstance(out, PolicyLossOutput):
            raise LossPipelineError(f"policy loss {self.policy_loss.name!r} returned {type(out).__name__}, "
                                    "expected PolicyLossOutput")
        if tuple(out.loss.shape) != tuple(mask.shape):
            raise LossPipelineError(f"policy loss {self.policy_loss.name!r} returned a loss of shape "
                                    f"{tuple(out.loss.shape)}; it must be per token {tuple(mask.shape)}")
        per_token = _masked(out.loss * weights, train_mask)
        pg_loss = self._aggregate(per_token, train_mask, norm)
        total = pg_loss
        metrics["pg_loss"] = pg_loss.detach()
        for key, value in out.metrics.items():
            metrics[key] = _per_token_metric(value, mask)

        teacher = micro.get(TEACHER_MASK_KEY)
        teacher_mask = None if teacher is None else train_mask * _on(teacher, logprobs)
        if self.kl is not None:
            # without distill_kl, teacher rows feed the kl term: only they are compared
            kl_mask = teacher_mask if teacher_mask is not None and self.distill is None else None
            kl_tok, kl_loss = self._term(self.kl, "ref_", micro, logprobs, mask, logits,
                                         train_mask if kl_mask is None else kl_mask, norm,
                                         teacher_fed=kl_mask is not None)
            total = total + self.kl_coef * kl_loss
            metrics["kl"] = kl_tok
            metrics["kl_loss"] = kl_loss.detach()

        if self.distill is not None:
            if teacher_mask is None:
                raise LossPipelineError(f"[algorithm] distill_kl = {self.distill.name!r} is set but the batch has no "
                                        f"'{TEACHER_MASK_KEY}'; the controller's teacher pass fills it")
            d_tok, d_loss = self._term(self.distill, "teacher_", micro, logprobs, mask, logits,
                                       teacher_mask, norm, teacher_fed=True)
            total = total + self.distill_coef * d_loss
            metrics["distill"] = d_tok
            metrics["distill_loss"] = d_loss.detach()

        if entropy is not None:
            if tuple(entropy.shape) != tuple(mask.shape):
                raise LossPipelineError(f"entropy has shape {tuple(entropy.shape)}, expected {tuple(mask.shape)}")
            metrics["entropy"] = entropy.detach()
            if self.entropy_coef != 0.0:
                entropy_loss = self._aggregate(_masked(entropy, train_mask), train_mask, norm)
                total = total - self.entropy_coef * entropy_loss
                metrics["entropy_loss"] = entropy_loss.detach()
        elif self.entropy_coef != 0.0:
            raise LossPipelineError("[algorithm] entropy_coef is set but no entropy was passed to the loss")

        metrics["loss"] = total.detach()
        return total, metrics

    # -- pieces ----------------------------------------------------------------------------------

    def _aggregate(self, values: "torch.Tensor", mask: "torch.Tensor", norm: AggregationNorm) -> "torch.Tensor":
        out = self.aggregation(values, mask, norm)
        if out.dim() != 0:
            raise LossPipelineError(f"loss aggregation {self.aggregation.name!r} returned shape {tuple(out.shape)}, "
                                    "expected a scalar")
        return out

    def _term(self, kl: Any, prefix: str, micro: Batch, logprobs: "torch.Tensor",
              mask: "torch.Tensor", logits: "torch.Tensor | None", term_mask: "torch.Tensor",
              norm: AggregationNorm, *, teacher_fed: bool) -> "tuple[torch.Tensor, torch.Tensor]":
        """A KL-style term against the ``<prefix>*`` tensors: its detached per-token values for the
        metrics and its aggregate over ``term_mask``. A teacher-fed term reports 0 on rows without
        a teacher and is not evaluated at all on a micro-batch without teacher rows."""
        import torch

        if teacher_fed and not bool((term_mask > 0).any()):
            return torch.zeros_like(mask), logprobs.sum() * 0.0
        tok = self._kl(kl, prefix, micro, logprobs, mask, logits)
        loss = self._aggregate(_masked(tok, term_mask), term_mask, norm)
        return (_masked(tok, term_mask) if teacher_fed else tok).detach(), loss

    def _kl(self, kl: Any, prefix: str, micro: Batch, logprobs: "torch.Tensor", mask: "torch.Tensor",
            logits: "torch.Tensor | None") -> "torch.Tensor":
        what = "the reference" if prefix == "ref_" else "the teacher"
        ref = require(micro, f"{prefix}logprobs", f"KL {kl.name!r} compares against {what}")
        inputs = KLInputs(logprobs=logprobs, ref_logprobs=_on(ref, logprobs), response_mask=mask)
        if kl.spec.requires in ("topk", "logits"):
            if logits is None:
                raise LossPipelineError(f"KL {kl.name!r} needs the full logits; pass logits= to loss()")
            inputs.logits = logits
            if kl.spec.requires == "topk":
                inputs.ref_topk_ids = require(micro, f"{prefix}topk_ids", f"KL {kl.name!r} uses {what}'s top-k")
                inputs.ref_topk_logprobs = require(micro, f"{prefix}topk_logprobs",
                                                    f"KL {kl.name!r} uses {what}'s top-k")
            else:
                inputs.ref_logits = require(micro, f"{prefix}logits", f"KL {kl.name!r} uses {what}'s logits")
        kl_tok = kl(inputs)
        if tuple(kl_tok.shape) != tuple(mask.shape):
            raise LossPipelineError(f"KL {kl.name!r} returned shape {tuple(kl_tok.shape)}, expected per-token "
                                    f"{tuple(mask.shape)}")
        return kl_tok


def train_inference_gap_per_token(old: "torch.Tensor", rollout: "torch.Tensor", mask: "torch.Tensor",
                                  ) -> dict[str, Any]:
    """The train-inference gap of :func:`loongsage_core.algorithms.step.train_inference_gap` as
    micro-batch metrics (per-token ``[B, T]`` values averaged over the loss mask, and a
    :class:`~.metrics.Maximum`), for steps whose old log-probs come from the training forward."""
    import torch

    r = (old.detach().double() - rollout.detach().double())
    on = mask > 0
    r = torch.where(on, r, torch.zeros_like(r))
    out: dict[str, Any] = {"is_approx_k3_kl": torch.expm1(r) - r, "logprob_abs_diff_mean": r.abs()}
    if bool(on.any()):
        out["logprob_abs_diff_max"] = Maximum(r.abs()[on].max())
    return out


def require(batch: Batch, key: str, why: str = "") -> "torch.Tensor":
    value = batch.get(key)
    if value is None:
        have = ", ".join(sorted(batch.tensors)) or "none"
        raise LossPipelineError(f"the batch has no '{key}' tensor{f' ({why})' if why else ''}; it has: {have}")
    return value


def _masked(values: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    """``values`` where ``mask`` is set and exactly 0 elsewhere (no NaN leaks from padding)."""
    import torch

    return torch.where(mask > 0, values, torch.zeros_like(values))


def _on(tensor: "torch.Tensor", like: "torch.Tensor") -> "torch.Tensor":
    return tensor.to(device=like.device, dtype=like.dtype)


def check_correction(name: str, out: Any, shape: Any) -> CorrectionOutput:
    if not isinstance(out, CorrectionOutput):
        raise LossPipelineError(f"correction {name!r} returned {type(out).__name__}, expected CorrectionOutput")
    for field in ("weights", "mask"):
        value = getattr(out, field)
        if value is not None and tuple(value.shape) != tuple(shape):
            raise LossPipelineError(f"correction {name!r} returned {field} of shape {tuple(value.shape)}, "
                                    f"expected {tuple(shape)}")
    return out


def combine_corrections(weights: "torch.Tensor", keep: "torch.Tensor", out: CorrectionOutput,
             ) -> "tuple[torch.Tensor, torch.Tensor]":
    if out.weights is not None:
        weights = weights * out.weights.detach().to(device=weights.device, dtype=weights.dtype)
    if out.mask is not None:
        keep = keep * out.mask.detach().to(device=keep.device, dtype=keep.dtype)
    return weights, keep


def _per_token_metric(value: Any, mask: "torch.Tensor") -> "torch.Tensor":
    """A metric as a ``[B, T]`` tensor: scalars are spread over the tokens (a token-weighted mean)."""
    import torch

    if hasattr(value, "dim") and value.dim() > 0:
        return value.detach()
    return torch.full_like(mask, float(value), dtype=torch.float32)


def mean_metric(value: Any, mask: "torch.Tensor") -> float:
    if hasattr(value, "dim") and value.dim() > 0:
        m = mask.to(value.device, dtype=value.dtype if value.is_floating_point() else mask.dtype)
        return float((value * m).sum() / m.sum().clamp_min(1))
    return float(value)
