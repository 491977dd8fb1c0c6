"""The megatron backend's checks of a whole job, before any rank starts.

:func:`check_job` is the backend's ``TrainBackendSpec.check_job``: ``loongsage validate`` (and
``loongsage run``, which validates first) calls it on the machine that reads the job file, so a
layout the model or the trainer's devices cannot run is refused there with the reason, not
minutes later when Megatron-Core starts on the cluster. It reads only the job and the model's
``config.json``: the devices come from ``[placement] trainer_gpus`` (a rank that reserves no GPU
sees no CUDA device), never from the validating machine's hardware. Each worker runs the same
checks (:func:`check_model_settings`) against its own devices when it starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import layout
from .layout import BackendOptions


def check_job(job: Any) -> None:
    """Raise ValueError naming the ``[train] backend_args`` key (or the job key) this job cannot
    run with on ``[train] num_workers`` ranks of the devices ``[placement]`` reserves."""
    options = BackendOptions.from_args(dict(job.train.backend_args))
    if not job.model.path:
        raise ValueError("[model] path must name a Hugging Face directory (Megatron-Bridge converts it)")
    config_file = Path(job.resolve_path(job.model.path)) / "config.json"
    if not config_file.is_file():
        return  # the job's model checks name the missing file
    hf_config = layout.read_hf_config(config_file)
    num_experts = layout.hf_num_experts(hf_config)
    tp, pp, _, _ = layout.parallel_sizes(options, int(job.train.num_workers), num_experts)
    cuda = float(job.placement.trainer_gpus) > 0
    layout.check_layout(options, "actor", tp, pp, hf_config, num_experts, cuda=cuda)
    check_model_settings(job, num_experts, str(config_file.parent))


def check_model_settings(job: Any, num_experts: int | None, model_path: str) -> None:
    """The job's algorithm settings this model cannot run: Router Replay (``[algorithm]
    router_replay``) needs routed experts."""
    if getattr(job.algorithm, "router_replay", False) and not num_experts:
        raise ValueError("[algorithm] router_replay = true, but the model has no mixture-of-experts layers "
                         f"(the config.json of '{model_path}' names no routed experts): there is no "
                         "routing to replay")
