"""Hook implementations of loongsage-plugin-megatron (the module its entry point names).

Provides the ``megatron`` train backend and the ``megatron`` distillation teacher. Megatron-Core,
Megatron-Bridge and torch are imported only when a worker or a teacher is built.
"""

from __future__ import annotations

from typing import Any, Iterator

from loongsage_hookspecs import (
    Closeable,
    ModelParallel,
    Offloadable,
    OnDevice,
    ResidentTeacher,
    StepwiseTraining,
    TeacherContext,
    TeacherSpec,
    TrainBackendSpec,
    hookimpl,
)

from .job_checks import check_job


def create_train_worker(ctx: Any) -> Any:
    """Build one rank of the megatron backend (``ctx`` is a ``TrainWorkerContext``)."""
    from .worker import MegatronTrainWorker

    return MegatronTrainWorker(ctx)


def create_teacher(ctx: TeacherContext, **args: Any) -> Any:
    """Build a ``megatron`` teacher from a ``[[teachers]]`` table's ``path`` (the context's) and ``args``."""
    from .teacher import MegatronTeacher

    return MegatronTeacher(ctx.path, **args)


@hookimpl
def loongsage_train_backends() -> Iterator[TrainBackendSpec]:
    yield TrainBackendSpec(name="megatron", factory=create_train_worker,
                           model_dtypes=("float32", "bfloat16", "float16"),
                           description="Megatron-Core GPT model built by Megatron-Bridge from a Hugging Face "
                                       "directory; tensor, pipeline (1F1B, interleaved with virtual stages), "
                                       "data (Megatron DDP) and, for Mixture-of-Experts models, expert and "
                                       "expert-tensor parallelism; activation recomputation; Megatron-Core Adam "
                                       "optimizer "
                                       "(float32, or bfloat16 / float16 with float32 master weights); "
                                       "LoRA through Megatron-Bridge's PEFT (dense models); vocabulary-level KL "
                                       "and distillation terms (full logits)",
                           supports_lora=True, check_job=check_job,
                           capabilities=(ModelParallel, Offloadable, OnDevice, Closeable, StepwiseTraining))


@hookimpl
def loongsage_teachers() -> Iterator[TeacherSpec]:
    yield TeacherSpec(name="megatron", factory=create_teacher,
                      description="frozen Megatron-Core GPT model built by Megatron-Bridge from a Hugging Face "
                                  "directory, run in the run's teacher actor (tp = pp = ep = 1; float32, "
                                  "bfloat16 or float16) with CPU offload; args dtype, device, micro_batch_size, "
                                  "output_device, logits_dtype, seed",
                      capabilities=(ResidentTeacher,))
