"""The distillation term a job trains with (:class:`DistillSetup`), read from its ``[algorithm]``
table and its ``[[data]]`` sources' teachers, and whether the run needs a frozen reference model.

The step's algorithm (:class:`~loongsage_core.algorithms.StepAlgorithm`) folds the term into the
rewards or leaves it to the loss; the controller's teachers (``loongsage_core.controller.teachers``)
fill the batch tensors the term reads. ``loongsage validate`` runs :func:`distill_setup`, so
distillation settings that do not fit together fail before anything starts.
"""

from __future__ import annotations

from typing import Any

import attrs

from loongsage_hookspecs import ComponentRef

from ..config import ConfigError, JobConfig, component_ref

REQUIRES_LEVELS = ("logprobs", "topk", "logits")


@attrs.define(frozen=True)
class DistillSetup:
    """The distillation term a job trains with, and what the teachers must fill for it.

    ``separate`` is true when the term comes from ``[algorithm] distill_kl`` (tensors prefixed
    ``teacher_``) and false when the teachers feed ``[algorithm] kl`` (prefix ``ref_``).
    ``topk`` is the number of teacher top-k entries computed per token (0 unless the term
    requires ``"topk"``); ``in_reward`` puts the term into the token rewards instead of the loss;
    ``ref`` names the term's ``kl`` component as the job does (to bind it).
    """

    kl_name: str
    requires: str
    kl_args: dict[str, Any]
    coef: float
    ref: ComponentRef
    in_reward: bool
    separate: bool
    topk: int

    @property
    def prefix(self) -> str:
        return "teacher_" if self.separate else "ref_"

    @property
    def return_logits(self) -> bool:
        return self.requires == "logits"

    def key(self, field: str) -> str:
        """Batch tensor name of a teacher output field (``logprobs``, ``topk_ids``, ...)."""
        return self.prefix + field


def runs_teachers(job: JobConfig) -> bool:
    """Whether the job distils: it lists ``[[teachers]]`` and a ``[[data]]`` source names one."""
    return bool(job.teachers) and any(src.teacher for src in job.data)


def distill_setup(job: JobConfig, host: Any) -> DistillSetup | None:
    """The job's distillation term, or ``None`` when no source names a teacher.

    Raises :class:`ConfigError` when sources name teachers but no term is selected, when a term
    that needs the student's logits is put into the rewards (the controller has only sampled
    log-probs), or when the term asks for more top-k entries than ``distill_topk`` provides.
    """
    where = job.source_path or "<job>"
    if not runs_teachers(job):
        return None
    alg = job.algorithm
    separate = bool(alg.distill_kl)
    if separate:
        name, args, coef, in_reward, key = alg.distill_kl, alg.distill_kl_args, alg.distill_coef, \
            alg.distill_in_reward, "algorithm.distill_kl"
    elif alg.kl:
        name, args, coef, in_reward, key = alg.kl, alg.kl_args, alg.kl_coef, alg.kl_in_reward, "algorithm.kl"
    else:
        sources = [src.name for src in job.data if src.teacher]
        raise ConfigError(f"{where}: data sources {sources} name a teacher but no distillation term is set; "
                          "set [algorithm] distill_kl (a term of its own, e.g. 'opd_k3') or [algorithm] kl")
    assert name is not None
    spec = host.get("kl", name, where=f"{where}: {key}")
    requires = spec.requires
    if in_reward and requires != "logprobs":
        flag = "distill_in_reward" if separate else "kl_in_reward"
        raise ConfigError(f"{where}: {key} = '{name}' requires '{requires}' (the student's logits), so it "
                          f"cannot go into the rewards; use a 'logprobs' term (e.g. 'opd_pg') with "
                          f"algorithm.{flag} = true, or put this term in the loss")
    topk = alg.distill_topk if requires == "topk" else 0
    wanted = _requested_k(args)
    if topk and wanted is not None and wanted > topk:
        raise ConfigError(f"{where}: {key}_args asks for k = {wanted} teacher top-k entries but "
                          f"algorithm.distill_topk = {topk} are computed; raise distill_topk")
    return DistillSetup(kl_name=name, requires=requires, kl_args=dict(args), coef=float(coef),
                        ref=component_ref(job, key),
                        in_reward=bool(in_reward), separate=separate, topk=topk)


def _requested_k(args: dict[str, Any]) -> int | None:
    """The top-k size a term's arguments ask for (``k``, or ``gkd_args.k`` of a mixture)."""
    nested = args.get("gkd_args")
    for table in (args, nested if isinstance(nested, dict) else {}):
        k = table.get("k")
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    return None


def uses_reference_model(job: JobConfig, host: Any) -> bool:
    """Whether the run needs the frozen reference model: a ``kl`` term with a non-zero
    coefficient that the teachers do not feed (they do when sources name teachers and
    ``distill_kl`` is unset)."""
    alg = job.algorithm
    if not alg.kl or alg.kl_coef == 0.0:
        return False
    setup = distill_setup(job, host)
    return setup is None or setup.separate
