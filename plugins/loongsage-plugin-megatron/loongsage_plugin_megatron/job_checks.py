"""The megatron backend's checks of a whole job, before any rank starts.

:func:`check_job` is the backend's ``TrainBackendSpec.check_job``: ``loongsage validate`` (and
``loongsage run``, which validates first) calls it on the machine that reads the job file, so a
layout the model or the trainer's devices cannot run is refused there with the reason, not
minutes later when Megatron-Core starts on the cluster. It reads only the job and the model's
``config.json``: the devices come from ``[placement] trainer_gpus`` (a rank that reserves no GPU
sees no CUDA device), never from the validating machine's hardware. Each worker runs the same
checks (:func:`job_layout`) against its own devices when it starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from . import layout
from .layout import BackendOptions


@attrs.define(frozen=True)
class JobLayout:
    """A job's megatron layout on its ranks, checked: the options, the model's ``config.json``,
    its routed experts and the ``(tp, pp, dp, ep)`` sizes."""

    options: BackendOptions
    hf_config: dict[str, Any]
    num_experts: int | None
    tp: int
    pp: int
    dp: int
    ep: int


def job_layout(job: Any, model_path: str, world_size: int, role: str, *, cuda: bool) -> JobLayout:
    """The layout of ``job`` on ``world_size`` ranks of a model in ``model_path``, for ``role``
    on ranks with (``cuda``) or without CUDA devices; ValueError naming the key at fault. What
    :func:`check_job` runs at validation and each worker again at start."""
    options = BackendOptions.from_args(dict(job.train.backend_args))
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"[model] path: no config.json in model directory '{model_path}'")
    hf_config = layout.read_hf_config(config_file)
    if "vision_config" in hf_config:
        raise ValueError(f"[model] path: '{model_path}' is a vision-language model (model_type "
                         f"{hf_config.get('model_type')!r}); the megatron backend trains text models only: "
                         "use [train] backend = \"torch\"")
    num_experts = layout.hf_num_experts(hf_config)
    tp, pp, dp, ep = layout.parallel_sizes(options, world_size, num_experts)
    layout.check_layout(options, role, tp, pp, hf_config, num_experts, cuda=cuda)
    check_model_settings(job, num_experts, model_path)
    return JobLayout(options, hf_config, num_experts, tp, pp, dp, ep)


def check_job(job: Any) -> None:
    """Raise ValueError naming the ``[train] backend_args`` key (or the job key) this job cannot
    run with on ``[train] num_workers`` ranks of the devices ``[placement]`` reserves."""
    BackendOptions.from_args(dict(job.train.backend_args))  # its keys, whatever the model
    if not job.model.path:
        raise ValueError("[model] path must name a Hugging Face directory (Megatron-Bridge converts it)")
    model_path = job.resolve_path(job.model.path)
    if not (Path(model_path) / "config.json").is_file():
        return  # the job's model checks name the missing file
    job_layout(job, model_path, int(job.train.num_workers), "actor", cuda=float(job.placement.trainer_gpus) > 0)


def check_model_settings(job: Any, num_experts: int | None, model_path: str) -> None:
    """The job's algorithm settings this model cannot run: Router Replay (``[algorithm]
    router_replay``) needs routed experts."""
    if job.algorithm.router_replay and not num_experts:
        raise ValueError("[algorithm] router_replay = true, but the model has no mixture-of-experts layers "
                         f"(the config.json of '{model_path}' names no routed experts): there is no "
                         "routing to replay")
