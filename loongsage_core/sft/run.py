"""The ``loongsage sft`` loop: one process, the job's train backend worker, no Ray.

Supervised fine-tuning has no rollouts, engines or router, so the controller's actors would only
add processes: the loop builds one worker of ``[train] backend`` in this process through the
backend's own factory (for the torch backend, :class:`TorchTrainWorker`: its model loading,
AdamW, LR schedule, gradient clipping, checkpoints and Hugging Face export) and drives it with
:meth:`train_mini_batch` on batches whose loss components are the SFT ones of :mod:`.loss`.

Each step logs ``sft/loss`` (mean NLL of the step's loss tokens), ``sft/grad_norm``, ``sft/lr``,
``sft/tokens`` and ``sft/epoch``; ``sft/eval_loss`` (mean NLL of the held-back examples) every
``[sft] eval_every`` steps and at the last step. The run directory follows ``loongsage run``:
``config.resolved.toml``, ``metrics.jsonl`` (JSONL logger), ``checkpoints/step_N/`` every
``[run] checkpoint_every`` steps (trainer state plus ``controller.json``, with a verified
manifest), resume with ``run.resume = true`` (bit-exact: weights, optimizer, schedule, RNG and the
step, from which the data order follows), ``final_hf/`` at the end.

LoRA: with ``[train] lora`` the worker trains a PEFT adapter instead of the whole model (the
backend's own LoRA support, nothing SFT-specific); checkpoints hold the adapter, ``final_hf/`` the
merged model and ``final_adapter/`` the PEFT adapter directory.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import attrs

from loongsage_hookspecs import Closeable, LoggerContext, StepTruncation

from ..config import AlgorithmConfig, JobConfig, SftConfig, component_ref, component_refs, dump_job_toml
from ..run_files import checkpoint as ckpt
from ..run_files.run_dir import prepare_run_dir
from ..validation import check_output_dir
from .data import SftData, load_examples, split_eval, step_batch, step_examples
from .loss import NLL_LOSS, TOKEN_MEAN, provide_sft_losses

log = logging.getLogger("loongsage")

def planned_steps(job: JobConfig, data: SftData) -> int:
    """Optimizer steps of the run: ``epochs`` passes over the training examples, capped by ``max_steps``."""
    cfg = job.sft or SftConfig()
    steps = cfg.epochs * data.steps_per_epoch(job.train.mini_batch_size)
    return min(steps, cfg.max_steps) if cfg.max_steps > 0 else steps


def trainer_job(job: JobConfig, total_steps: int) -> JobConfig:
    """The job as the train worker reads it: SFT's loss components and the run's step count (for
    the LR schedule)."""
    return attrs.evolve(job, algorithm=AlgorithmConfig(policy_loss=NLL_LOSS, loss_agg=TOKEN_MEAN),
                        train=attrs.evolve(job.train, total_steps=total_steps))


def _norm(batch: Any) -> Any:
    from loongsage_hookspecs import AggregationNorm

    mask = batch["loss_mask"]
    return AggregationNorm(num_tokens=float(mask.sum()), num_sequences=float(len(batch)),
                           max_response_length=float(mask.sum(dim=1).max()))


class SftRun:
    """One ``loongsage sft`` run in ``output_dir`` (see the module docstring)."""

    def __init__(self, job: JobConfig, host: Any, output_dir: Path) -> None:
        from ..agentflow.tito import ChatRenderer
        from ..hf_models import load_tokenizer

        self.job = job
        self.host = host
        self.cfg = job.sft or SftConfig()
        self.output_dir = output_dir
        where = job.source_path or "<job>"
        self.tokenizer = load_tokenizer(job)
        renderer = ChatRenderer(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else renderer.turn_end_ids[0])
        self.data = split_eval(load_examples(job, renderer, host), self.cfg, job.run.seed, where)
        self.total_steps = planned_steps(job, self.data)
        self.step = 0
        self.worker: Any = None
        self.loggers: list[Any] = []

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Build the worker, restore a checkpoint when resuming, start the loggers."""
        from loongsage_hookspecs import TrainWorkerContext

        provide_sft_losses(self.host)
        backend = component_ref(self.job, "train.backend")
        ctx = TrainWorkerContext(where=backend.where, job=trainer_job(self.job, self.total_steps),
                                 components=self.host)
        self.worker = self.host.bind(backend, ctx)
        if self.job.run.resume:
            point, skipped = ckpt.find_resumable(self.output_dir)
            ckpt.warn_skipped(skipped, point.directory if point else None)
            if point is not None:
                self.worker.load_checkpoint(str(point.directory / "trainer"))
                self.step = point.step
                log.info("resumed SFT from %s (step %d)", point.directory, point.step)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.resolved.toml").write_text(dump_job_toml(self.job))
        for ref in component_refs(self.job, kinds=("logger",)):
            log_ctx = LoggerContext(where=ref.where, job=self.job, components=self.host,
                                    output_dir=str(self.output_dir), total_steps=self.total_steps,
                                    start_step=self.step)
            logger = self.host.bind(ref, log_ctx)
            if isinstance(logger, StepTruncation):
                logger.truncate_after(self.step)
            self.loggers.append(logger)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
        self.loggers = []
        if isinstance(self.worker, Closeable):
            self.worker.close()
        self.worker = None

    # -- steps -------------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step on the examples of ``step``; returns its ``sft/*`` metrics."""
        t0 = time.perf_counter()
        examples = step_examples(self.data, step, self.job.train.mini_batch_size, seed=self.job.run.seed,
                                 shuffle=self.cfg.shuffle)
        batch = step_batch(examples, self.cfg, self.pad_id)
        out = self.worker.train_mini_batch(batch, _norm(batch))
        per_epoch = self.data.steps_per_epoch(self.job.train.mini_batch_size)
        return {"sft/loss": float(out["train/loss"]), "sft/grad_norm": float(out["train/grad_norm"]),
                "sft/lr": float(out["train/lr"]), "sft/skipped_step": float(out["train/skipped_step"]),
                "sft/tokens": float(batch["loss_mask"].sum()), "sft/rows": float(len(batch)),
                "sft/epoch": float(step // per_epoch), "timing/step": time.perf_counter() - t0}

    def eval_loss(self) -> float:
        """Mean negative log-likelihood of the held-back examples' loss tokens (no gradient)."""
        mbs = self.job.train.mini_batch_size
        total, count = 0.0, 0.0
        for start in range(0, len(self.data.eval), mbs):
            batch = step_batch(self.data.eval[start:start + mbs], self.cfg, self.pad_id)
            logprobs = self.worker.forward(batch)["logprobs"]
            mask = batch["loss_mask"]
            total -= float((logprobs.double() * mask.double()).sum())
            count += float(mask.sum())
        return total / count if count else math.nan

    def fit(self) -> list[dict[str, float]]:
        """Train from the current step to the last; returns every step's metrics."""
        history = []
        every = self.job.run.checkpoint_every
        while self.step < self.total_steps:
            step = self.step
            metrics = self.train_step(step)
            last = step + 1 == self.total_steps
            if self.data.eval and (last or (self.cfg.eval_every and (step + 1) % self.cfg.eval_every == 0)):
                metrics["sft/eval_loss"] = self.eval_loss()
            metrics["step"] = step
            history.append(metrics)
            for lg in self.loggers:
                lg.log(step, metrics)
            self.step = step + 1
            if every > 0 and self.step % every == 0:
                self.save(self.step)
        if self.job.run.save_hf_at_end:
            self.worker.save_hf(str(self.output_dir / "final_hf"))
            if self.job.train.lora is not None:  # the adapter alone too, as a PEFT directory
                self.worker.save_adapter(str(self.output_dir / "final_adapter"))
        return history

    def save(self, step: int) -> None:
        """A checkpoint of ``step``: the worker's state, then ``controller.json`` and the manifest."""
        directory = ckpt.prepare_step_dir(self.output_dir, step)
        self.worker.save_checkpoint(str(directory / "trainer"))
        ckpt.write_controller_state(self.output_dir, step, {"step": step, "kind": "sft"},
                                    self.job.run.keep_checkpoints)


def run_sft(job: JobConfig, host: Any, output_dir: str | None = None, *, overwrite: bool = False,
            ) -> list[dict[str, float]]:
    """Train ``job`` with supervised fine-tuning; returns the metrics of every step run.

    The run directory follows ``loongsage run``'s rules (resume, ``--overwrite``, refusal).
    """
    out = Path(output_dir or job.resolve_path(job.run.output_dir))
    where = job.source_path or "<job>"
    check_output_dir(out, "--output-dir" if output_dir else f"{where}: run.output_dir")
    prepare_run_dir(out, resume=job.run.resume, overwrite=overwrite, where=where)
    run = SftRun(job, host, out)
    try:
        run.start()
        return run.fit()
    finally:
        run.close()
