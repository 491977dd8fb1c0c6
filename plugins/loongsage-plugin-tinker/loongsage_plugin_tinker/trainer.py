"""One Tinker training model: a worker of the job's train backend driven call by call.

Tinker splits a step into ``forward_backward`` calls (gradients add up) and an ``optim_step``
with the step's Adam hyperparameters. The train backend's worker (``[train] backend``, bound
through the plugin host) does the same work through its ``StepwiseTraining`` capability:
``accumulate_gradients`` under the loss pipeline of the call's ``loss_fn`` (see :mod:`.losses`)
and ``optimizer_step`` with the step's learning rate, betas, eps, weight decay and gradient
clipping. A backend without it (one that only trains whole mini-batches) cannot serve Tinker
clients and is refused when the model is created.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from loongsage_hookspecs import StepwiseTraining

from .batches import Datum, TinkerRequestError, check_datums, datum_loss, make_batch, per_datum
from .losses import LOSS_CONFIG_KEYS, LOSSES, SUM

_NEEDED = ("forward", "save_checkpoint", "load_checkpoint", "save_hf")


@attrs.define
class ModelSpec:
    """What ``create_model`` asked for: the base model's name and directory, and LoRA (rank) or not."""

    name: str
    path: str
    lora_rank: int | None
    seed: int | None = None


def model_job(job: Any, spec: ModelSpec) -> Any:
    """The service's job as the train worker of ``spec`` reads it."""
    from loongsage_core.backend_api.schema import AlgorithmConfig, LoraConfig

    model = attrs.evolve(job.model, path=spec.path, tokenizer=spec.path, config={})
    lora = None
    if spec.lora_rank is not None:
        base = job.train.lora or LoraConfig()
        lora = attrs.evolve(base, rank=int(spec.lora_rank), alpha=float(base.alpha))
    train = attrs.evolve(job.train, lora=lora, grad_clip=0.0, lr_schedule="constant", lr_warmup_steps=0)
    run = attrs.evolve(job.run, seed=int(spec.seed)) if spec.seed is not None else job.run
    algorithm = AlgorithmConfig(policy_loss=LOSSES["cross_entropy"], loss_agg=SUM)
    return attrs.evolve(job, model=model, train=train, run=run, algorithm=algorithm)


class TrainingModel:
    """The worker of one training model and the Tinker operations on it (blocking; one thread)."""

    def __init__(self, job: Any, host: Any, spec: ModelSpec) -> None:
        from loongsage_hookspecs import ComponentRef, TrainWorkerContext

        self.spec = spec
        self.host = host
        self.job = model_job(job, spec)
        ref = ComponentRef("train_backend", self.job.train.backend, where="[train] backend")
        self.worker = host.bind(ref, TrainWorkerContext(where=ref.where, job=self.job, components=host))
        missing = [m for m in _NEEDED if not callable(getattr(self.worker, m, None))]
        if not isinstance(self.worker, StepwiseTraining):
            missing.append("the StepwiseTraining capability (steps driven call by call)")
        if missing:
            raise TinkerRequestError(f"[train] backend {self.job.train.backend!r} cannot serve Tinker: its worker "
                                     f"lacks {', '.join(missing)}")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec.path)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad or 0)
        self._pipelines: dict[tuple[str, tuple[tuple[str, float], ...]], Any] = {}
        self.steps = 0

    # -- losses --------------------------------------------------------------------------------------

    def _pipeline(self, loss_fn: str, config: dict[str, float]) -> Any:
        from loongsage_core.backend_api.loss import LossPipeline

        key = (loss_fn, tuple(sorted(config.items())))
        if key not in self._pipelines:
            algorithm = attrs.evolve(self.job.algorithm, policy_loss=LOSSES[loss_fn], policy_loss_args=dict(config),
                                     loss_agg=SUM)
            self._pipelines[key] = LossPipeline.from_job(attrs.evolve(self.job, algorithm=algorithm), self.host)
        return self._pipelines[key]

    @staticmethod
    def check_loss(loss_fn: str, config: dict[str, float]) -> None:
        if loss_fn not in LOSSES:
            raise TinkerRequestError(f"loss_fn {loss_fn!r} is not supported by this service (supported: "
                                     f"{', '.join(LOSSES)}); a custom loss runs through forward_backward_custom")
        unknown = sorted(set(config) - set(LOSS_CONFIG_KEYS[loss_fn]))
        if unknown:
            raise TinkerRequestError(f"loss_fn {loss_fn!r}: unknown loss_fn_config keys {unknown} "
                                     f"(accepted: {list(LOSS_CONFIG_KEYS[loss_fn]) or 'none'})")
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        if loss_fn == "ppo" and not 0.0 <= low <= 1.0 <= high:
            raise TinkerRequestError(f"loss_fn 'ppo': loss_fn_config needs 0 <= clip_low_threshold <= 1 <= "
                                     f"clip_high_threshold, got {low} and {high}")

    # -- operations ----------------------------------------------------------------------------------

    def forward_backward(self, data: Sequence[Datum], loss_fn: str, config: dict[str, float], *,
                         forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-datum ``logprobs`` of the targets at the current weights, and ``loss:sum``;
        without ``forward_only`` the call's gradients are added to the model's."""
        from loongsage_hookspecs import AggregationNorm

        if not data:
            raise TinkerRequestError("forward_backward: no data")
        self.check_loss(loss_fn, config)
        check_datums(data, loss_fn, forward_only=forward_only)
        batch = make_batch(data, loss_fn, self.pad_id)
        logprobs = per_datum(self.worker.forward(batch)["logprobs"], data)
        outputs, total = [], 0.0
        for datum, lp in zip(data, logprobs):
            total += datum_loss(loss_fn, datum, lp, config)
            outputs.append({"logprobs": lp})
        metrics = {"loss:sum": total}
        if not forward_only:
            mask = batch["loss_mask"]
            norm = AggregationNorm(num_tokens=float(mask.sum()), num_sequences=float(len(batch)),
                                   max_response_length=float(mask.sum(dim=1).max()))
            self.worker.accumulate_gradients(batch, norm, pipeline=self._pipeline(loss_fn, config))
        return outputs, metrics

    def optim_step(self, params: dict[str, Any]) -> dict[str, float]:
        """One AdamW step on the gradients accumulated since the last, with ``params`` (AdamParams)."""
        lr = float(params.get("learning_rate", 1e-4))
        out = self.worker.optimizer_step(hyperparameters={
            "lr": lr, "beta1": float(params.get("beta1", 0.9)), "beta2": float(params.get("beta2", 0.95)),
            "eps": float(params.get("eps", 1e-12)), "weight_decay": float(params.get("weight_decay", 0.0)),
            "grad_clip": float(params.get("grad_clip_norm", 0.0))})
        self.steps += 1
        return {"grad_norm:mean": float(out.get("train/grad_norm", 0.0)), "learning_rate:mean": lr}

    def save_state(self, directory: Path) -> None:
        self.worker.save_checkpoint(str(directory))

    def load_state(self, directory: Path, *, optimizer: bool) -> None:
        """The weights (and the optimizer state when ``optimizer``) of a :meth:`save_state` directory."""
        self.worker.load_checkpoint(str(directory))
        if not optimizer:
            self.worker.reset_optimizer_state()

    def save_for_sampler(self, directory: Path) -> None:
        """A Hugging Face directory of the current weights (LoRA merged) for the sampling engines."""
        self.worker.save_hf(str(directory))

    def close(self) -> None:
        close = getattr(self.worker, "close", None)
        if callable(close):
            close()
