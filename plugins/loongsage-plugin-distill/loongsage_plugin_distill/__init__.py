"""LoongSage plugin: on-policy distillation (teacher providers and distillation terms).

Public API (no torch import at package import; torch loads on first use):

* distillation terms ``fn(inputs: KLInputs, **args) -> Tensor [B, T]``: :func:`pg`, :func:`k2`,
  :func:`k3`, :func:`topk_kl`, :func:`full_kl`, :func:`jsd`, :class:`MixTerm` (registered as
  ``opd_*`` KL components), plus :func:`penalize_advantages` and :func:`pg_surrogate`;
* :func:`distill_metrics` (``train/opd_*`` masked means);
* :class:`TeacherManager` / :func:`make_teacher_manager` (per-source routing to several teachers, bounded
  residency; the ``per_source`` teacher manager);
* :class:`TorchTeacher` / :func:`make_torch_teacher` (the ``torch`` teacher backend).
"""

from .metrics import distill_metrics
from .teacher_manager import TeacherManager, TeacherRoutingError, make_teacher_manager
from .terms import (
    GKD_TERMS,
    MixTerm,
    full_kl,
    jsd,
    k2,
    k3,
    kl_rows,
    penalize_advantages,
    pg,
    pg_surrogate,
    topk_kl,
)
from .torch_teacher import TeacherLoadError, TorchTeacher, make_torch_teacher

__version__ = "0.1.0"
