"""Hook implementations of loongsage-plugin-distill (the module its entry point names).

Each hook only lists specs; the code lives in the modules beside this one. None of them imports
torch at import time, so importing this module and listing its components stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterator

from loongsage_hookspecs import KLSpec, ResidentTeacher, TeacherManagerSpec, TeacherSpec, hookimpl

from . import terms, torch_teacher
from .metrics import distill_metrics
from .teacher_manager import make_teacher_manager


@hookimpl
def loongsage_kls() -> Iterator[KLSpec]:
    yield KLSpec(name="opd_pg", fn=terms.pg, requires="logprobs",
                 description="on-policy distillation, PG style: detached logp - teacher_logp per token, for "
                             "advantage -= coef * value (kl_in_reward); arg clamp")
    yield KLSpec(name="opd_k2", fn=terms.k2, requires="logprobs",
                 description="(logp - teacher_logp)^2 / 2 on sampled tokens (reverse-KL gradient); arg clamp")
    yield KLSpec(name="opd_k3", fn=terms.k3, requires="logprobs",
                 description="exp(teacher_logp - logp) - (teacher_logp - logp) - 1 on sampled tokens; "
                             "args clamp, log_ratio_clamp")
    yield KLSpec(name="opd_topk_kl", fn=terms.topk_kl, requires="topk",
                 description="KL over the teacher's top-k ids (+ tail bucket or renormalised); "
                             "args k, direction, mode, tail_eps, vocab_size")
    yield KLSpec(name="opd_full_kl", fn=terms.full_kl, requires="logits",
                 description="exact full-vocabulary KL to the teacher; args direction (forward|reverse), vocab_size")
    yield KLSpec(name="opd_jsd", fn=terms.jsd, requires="logits",
                 description="generalised JSD, beta in [0, 1] (0: forward KL, 1: reverse KL); "
                             "args beta, normalize, vocab_size")
    for requires in ("logprobs", "topk", "logits"):
        mix = terms.MixTerm(requires)
        yield KLSpec(name=mix.name, fn=mix, requires=requires,
                     description=f"pg_ratio * PG surrogate + gkd_ratio * GKD term ({', '.join(mix.ALLOWED[requires])});"
                                 " args gkd, pg_ratio, gkd_ratio, gkd_args, pg_clamp")


@hookimpl
def loongsage_teachers() -> Iterator[TeacherSpec]:
    yield TeacherSpec(name="torch", factory=torch_teacher.make_torch_teacher,
                      description="frozen transformers causal LM (local directory or inline config) with CPU "
                                  "offload; args dtype, device, micro_batch_size, output_device, logits_dtype",
                      capabilities=(ResidentTeacher,))


@hookimpl
def loongsage_teacher_managers() -> Iterator[TeacherManagerSpec]:
    yield TeacherManagerSpec(name="per_source", factory=make_teacher_manager, metrics=distill_metrics,
                             description="each data source's rows to its teacher, at most max_resident teachers "
                                         "loaded (least recently used offloaded first); train/opd_* metrics")
