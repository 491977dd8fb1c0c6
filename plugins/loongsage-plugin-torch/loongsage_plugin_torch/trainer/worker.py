"""``TorchTrainWorker``: one data-parallel rank of the embedded PyTorch trainer.

The model is a ``transformers`` causal LM loaded by :func:`loongsage_plugin_torch.modeling.load_model`
(identical on every rank: same seed, then a broadcast from rank 0). A mini-batch is split into
micro-batches of ``[train] micro_batch_size`` rows; each micro-batch loss comes from the host's
:class:`~loongsage_core.algorithms.LossPipeline` already divided by the mini-batch's global norm,
so gradients add up across micro-batches and ranks (summed with ``torch.distributed``), then one
AdamW step follows.

``[train] backend_args`` of this backend:

* ``device``: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``;
* ``master_weights``: ``"float32"`` (default: parameters and optimizer in float32, the decoder runs
  under autocast in ``[model] dtype``) or ``"model"`` (parameters stored in ``[model] dtype``);
* ``forward_micro_batch_size``: rows per chunk of :meth:`forward` (default ``micro_batch_size``);
* ``dist_backend``: ``"auto"`` (NCCL on CUDA, Gloo on CPU), ``"gloo"`` or ``"nccl"``;
* ``grad_sync_bucket_mb``: size of the flat gradient buckets all-reduced across ranks (64);
* ``rollback_overflow``: take back an optimizer step whose update made a weight non-finite
  (default ``true``: the parameters and optimizer state are copied before each step, see
  :mod:`.rollback`); ``false`` saves that copy, and such a step ends the run.

With ``[train] lora`` the policy is wrapped in a PEFT LoRA adapter (:mod:`..lora`): only the
adapter trains; checkpoints hold the adapter and its optimizer state (the base weights are
reloaded from ``[model]``); :meth:`TorchTrainWorker.named_weights` yields the adapter alone (what
the weight transports send); :meth:`TorchTrainWorker.reference_forward` scores with the adapter
disabled, so a KL reference needs no second copy of the weights; :meth:`TorchTrainWorker.save_hf`
writes the merged model and :meth:`TorchTrainWorker.save_adapter` the PEFT adapter directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import attrs
import torch

from loongsage_core.backend_api import (
    LossPipeline,
    MetricAccumulator,
    make_scheduler,
    old_from_training_forward,
    structure_args,
)
from loongsage_hookspecs import AggregationNorm, Batch, TrainWorkerContext

from .. import lora as lora_lib
from ..modeling import load_model, load_tokenizer, torch_dtype
from . import distributed
from .checkpoint import capture_rng, restore_rng, seed_everything
from .logits import logprobs_and_entropy, next_token_logits
from .packing import packed_token_outputs, plan_micro_batches
from .rollback import StepSnapshot, is_overflow_error, nonfinite_count

STATE_FILE = "trainer_state.pt"
RNG_FILE = "rng_rank{rank}.pt"
CHECKPOINT_FORMAT = 1
ADAPTER_ONLY = "adapter"
"""``trainer_state.pt`` ``"weights"`` value of a LoRA run's checkpoint (its model entry is the adapter)."""


@attrs.define(frozen=True)
class BackendOptions:
    """The validated ``[train] backend_args`` of the torch backend (see the module docstring)."""

    device: str = "auto"
    master_weights: str = attrs.field(default="float32", validator=attrs.validators.in_(("float32", "model")))
    forward_micro_batch_size: int | None = None
    dist_backend: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "gloo", "nccl")))
    grad_sync_bucket_mb: float = 64.0
    rollback_overflow: bool = True

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "BackendOptions":
        return structure_args(cls, args, "[train] backend_args", "torch backend")


def resolve_device(name: str) -> torch.device:
    """The torch device for ``backend_args.device`` (``auto`` picks the current CUDA device if any)."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"[train] backend_args.device = {name!r} but CUDA is not available")
    return device


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute activations in the backward pass (non-reentrant), in either transformers naming."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x naming
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class TorchTrainWorker:
    """One rank of the torch train backend (implements ``loongsage_hookspecs.TrainWorker``).

    ``ctx.role`` ``"actor"`` builds a trainable policy; ``"reference"`` a frozen model that only
    runs :meth:`forward` (and accepts :meth:`load_weights` for periodic reference updates).
    """

    def __init__(self, ctx: TrainWorkerContext) -> None:
        job = ctx.job
        if ctx.role not in ("actor", "reference"):
            raise ValueError(f"torch train backend: role {ctx.role!r} is not supported by TorchTrainWorker "
                             "(actor, reference; create_train_worker builds the critic's TorchCriticWorker)")
        trainable = ctx.role == "actor"
        self._init_rank(ctx, micro_batch_size=job.train.micro_batch_size, section="train", trainable=trainable,
                        training="be trained")
        self.fp32_lm_head = bool(job.model.fp32_lm_head)

        model: Any = load_model(job)
        param_dtype = torch.float32 if trainable and self.options.master_weights == "float32" else self.compute_dtype
        model = model.to(device=self.device, dtype=param_dtype)
        self.lora = job.train.lora if trainable else None
        self.peft_model: Any = None
        if self.lora is not None:
            # the base model keeps its class and names, with LoRA layers injected into it
            self.peft_model = lora_lib.apply_lora(model, self.lora)
            model = self.peft_model.get_base_model()
        self.model: Any = model
        self.global_step = 0
        self.training_forward_logprobs: torch.Tensor | None = None  # of the last mini-batch, when they are old ones
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.pipeline: LossPipeline | None = None
        self._offloaded = False
        if not trainable:
            self.model.requires_grad_(False)
            self.model.eval()
            return

        if job.train.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        if distributed.is_distributed():
            distributed.broadcast_parameters(self.model.state_dict().values())
        self.pipeline = LossPipeline(job, ctx.components)
        self._init_optimizer([p for p in self.model.parameters() if p.requires_grad], lr=job.train.lr)
        self.model.train()

    def _init_rank(self, ctx: TrainWorkerContext, *, micro_batch_size: int, section: str, trainable: bool,
                   training: str) -> None:
        """What every rank of the backend sets up alike (policy, reference and critic): its place in
        the group, the ``[train] backend_args`` options, batch sizes, device and dtype, the
        process group of a trainable data-parallel role, and the seed."""
        job = ctx.job
        self.job = job
        self.role = ctx.role
        self.rank = int(ctx.rank)
        self.world_size = int(ctx.world_size)
        self.options = BackendOptions.from_args(dict(job.train.backend_args))
        if micro_batch_size < 1:
            raise ValueError(f"[{section}] micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = job.train.max_tokens_per_micro_batch
        self.forward_micro_batch_size = self.options.forward_micro_batch_size or self.micro_batch_size
        if self.forward_micro_batch_size < 1:
            raise ValueError("[train] backend_args.forward_micro_batch_size must be >= 1")
        self.device = resolve_device(self.options.device)
        self.compute_dtype = torch_dtype(job.model.dtype)
        if trainable and self.compute_dtype == torch.float16:
            raise ValueError(f"torch train backend: [model] dtype = 'float16' cannot {training} without loss "
                             "scaling; use 'bfloat16' or 'float32'")
        if trainable and self.world_size > 1:
            backend = self.options.dist_backend
            if backend == "auto":
                backend = "nccl" if self.device.type == "cuda" else "gloo"
            distributed.init_process_group(rank=self.rank, world_size=self.world_size,
                                           master_addr=ctx.master_addr, master_port=int(ctx.master_port),
                                           backend=backend)
        seed_everything(int(job.run.seed) + self.rank)

    def _init_optimizer(self, params: Any, *, lr: float) -> None:
        """AdamW over ``params`` with the ``[train]`` betas, eps and weight decay, and its LR schedule."""
        train = self.job.train
        if len(train.betas) != 2:
            raise ValueError(f"[train] betas must have two values, got {train.betas}")
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=(train.betas[0], train.betas[1]), eps=train.eps,
                                           weight_decay=train.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, train)

    # ------------------------------------------------------------------------------------------
    # Forward passes
    # ------------------------------------------------------------------------------------------

    def _to_device(self, micro: Batch) -> Batch:
        return Batch(tensors={k: v.to(self.device, non_blocking=True) for k, v in micro.tensors.items()},
                     meta=micro.meta)

    def _token_outputs(self, micro: Batch, *, entropy_grad: bool, keep_logits: bool = False,
                       ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]":
        """Log-probs, entropies ``[b, T]`` and (optionally) next-token logits of one micro-batch.

        Padding positions hold 0; columns past the micro-batch's longest row are not computed.
        """
        ids = micro["input_ids"]
        attention = micro.get("attention_mask")
        if attention is None:
            attention = torch.ones_like(ids)
        # padding-free micro-batches (.packing); rows that are already packed (SFT) keep their own positions
        if (self.max_tokens_per_micro_batch and not keep_logits and "position_ids" not in micro
                and bool(attention.any())):
            logprobs, entropy = packed_token_outputs(self.model, ids, attention, compute_dtype=self.compute_dtype,
                                                     fp32_lm_head=self.fp32_lm_head, entropy_grad=entropy_grad)
            return logprobs, entropy, None
        width = int(attention.sum(dim=1).max()) if ids.shape[0] else 0
        full_width = ids.shape[1]
        width = max(width, 1)
        positions = micro.get("position_ids")  # packed rows (SFT): attention stays within each sequence
        logits = next_token_logits(self.model, ids[:, :width], attention[:, :width],
                                   compute_dtype=self.compute_dtype, fp32_lm_head=self.fp32_lm_head,
                                   position_ids=None if positions is None else positions[:, :width])
        logprobs, entropy = logprobs_and_entropy(logits, ids[:, :width], entropy_grad=entropy_grad)
        assert entropy is not None
        real = attention[:, :width] > 0
        logprobs = torch.where(real, logprobs, torch.zeros_like(logprobs))
        entropy = torch.where(real, entropy, torch.zeros_like(entropy))
        if width < full_width:
            pad = (0, full_width - width)
            logprobs = torch.nn.functional.pad(logprobs, pad)
            entropy = torch.nn.functional.pad(entropy, pad)
            if keep_logits:
                logits = torch.nn.functional.pad(logits, (0, 0, 0, full_width - width))
        return logprobs, entropy, logits if keep_logits else None

    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` ``[B, T]`` (float32, on the CPU, no gradient)."""
        def outputs(micro: Batch) -> dict[str, torch.Tensor]:
            lp, ent, _ = self._token_outputs(micro, entropy_grad=False)
            return {"logprobs": lp, "entropy": ent}

        return self._forward_chunks(batch, ("logprobs", "entropy"), outputs)

    @property
    def serves_reference(self) -> bool:
        """Whether this worker scores the KL reference itself (:meth:`reference_forward`): a LoRA
        policy's reference is its base model, the adapter disabled, so no reference worker is built."""
        return self.peft_model is not None

    @torch.no_grad()
    def reference_forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """:meth:`forward` of the base model, the LoRA adapter disabled (the KL reference of a
        LoRA run; the same weights, no second copy)."""
        if self.peft_model is None:
            raise RuntimeError("TorchTrainWorker.reference_forward: the policy has no LoRA adapter to disable; "
                               "the reference is a worker of its own (role 'reference')")
        with self.peft_model.disable_adapter():
            return self.forward(batch)

    def _forward_chunks(self, batch: Batch, keys: tuple[str, ...],
                        outputs: Callable[[Batch], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run ``outputs`` over ``batch`` in forward micro-batches, in eval mode, and concatenate
        its ``[b, T]`` tensors on the CPU (``[0, T]`` zeros for an empty batch)."""
        name = type(self).__name__
        if "input_ids" not in batch:
            raise KeyError(f"{name}.forward: the batch has no 'input_ids' tensor")
        if self._offloaded:
            raise RuntimeError(f"{name}.forward: the worker is offloaded; call onload() first")
        was_training = self.model.training
        self.model.eval()
        plan = self._micro_batch_rows(batch, self.forward_micro_batch_size)
        try:
            parts = [outputs(self._to_device(batch.select(rows))) for rows in plan]
        finally:
            self.model.train(was_training)
        if not parts:
            return {k: torch.zeros(0, batch["input_ids"].shape[1]) for k in keys}
        out = {k: torch.cat([p[k].cpu() for p in parts]) for k in keys}
        order = [r for rows in plan for r in rows]
        if order != list(range(len(order))):  # packed micro-batches: back to the batch's row order
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.as_tensor(order)] = torch.arange(len(order))
            out = {k: v.index_select(0, inverse) for k, v in out.items()}
        return out

    def _micro_batch_rows(self, batch: Batch, rows_per_micro: int) -> list[list[int]]:
        """Row indices of each micro-batch: packed by ``[train] max_tokens_per_micro_batch`` when
        it is set (:mod:`.packing`), else consecutive chunks of ``rows_per_micro`` rows."""
        n = len(batch)
        if self.max_tokens_per_micro_batch and "attention_mask" in batch:
            return plan_micro_batches(batch["attention_mask"].sum(dim=1).tolist(), self.max_tokens_per_micro_batch)
        return [list(range(s, min(s + rows_per_micro, n))) for s in range(0, n, rows_per_micro)]

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------

    def _require_trainable(self, what: str) -> tuple[torch.optim.Optimizer, LossPipeline]:
        if self.optimizer is None or self.pipeline is None:
            raise RuntimeError(f"TorchTrainWorker.{what}: the {self.role!r} worker is forward-only")
        if self._offloaded:
            raise RuntimeError(f"TorchTrainWorker.{what}: the worker is offloaded; call onload() first")
        return self.optimizer, self.pipeline

    def accumulate_gradients(self, batch: Batch, norm: AggregationNorm) -> dict[str, float]:
        """Forward and backward over ``batch`` in micro-batches, then sum gradients over ranks.

        Gradients are added to the parameters' ``.grad`` (no optimizer step); returns the
        ``train/*`` loss metrics of the whole mini-batch (all ranks).
        """
        _, pipeline = self._require_trainable("accumulate_gradients")
        self.model.train()
        entropy_grad = pipeline.entropy_coef != 0.0
        acc = MetricAccumulator()
        keep_old = old_from_training_forward(batch)  # they are the step's old log-probs: keep them
        kept: list[torch.Tensor] = []
        plan = self._micro_batch_rows(batch, self.micro_batch_size)
        for rows in plan:
            micro = self._to_device(batch.select(rows))
            logprobs, entropy, logits = self._token_outputs(micro, entropy_grad=entropy_grad,
                                                            keep_logits=pipeline.needs_logits)
            loss, metrics = pipeline.loss(micro, logprobs, entropy, norm, logits=logits)
            loss.backward()
            acc.add(metrics, micro["loss_mask"])
            if keep_old:
                kept.append(logprobs.detach().float().cpu())
        self.training_forward_logprobs = None
        if kept:
            old = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
            old[torch.as_tensor([r for rows in plan for r in rows], dtype=torch.long)] = torch.cat(kept)
            self.training_forward_logprobs = old
        if distributed.is_distributed():
            distributed.sum_gradients(self.model.parameters(),
                                      bucket_bytes=int(self.options.grad_sync_bucket_mb * (1 << 20)))
        acc.reduce()
        return acc.result()

    def optimizer_step(self) -> dict[str, float]:
        """Clip the accumulated gradients, take one AdamW step, advance the LR schedule.

        A step whose gradient norm is not finite is skipped (``train/skipped_step`` = 1); the
        schedule still advances so resumed and uninterrupted runs stay aligned. A step whose
        update made a weight non-finite (``train/nonfinite_weights`` tensors) is taken back: the
        parameters and optimizer state are restored bit for bit (``train/rolled_back_step`` = 1,
        ``train/skipped_step`` = 1), unless ``backend_args.rollback_overflow = false``.
        """
        optimizer, _ = self._require_trainable("optimizer_step")
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        clip = self.job.train.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        lr = float(optimizer.param_groups[0]["lr"])
        finite = bool(torch.isfinite(grad_norm))
        nonfinite_weights = 0
        rolled_back = False
        if finite:
            snapshot = StepSnapshot(params, optimizer) if self.options.rollback_overflow else None
            try:
                optimizer.step()
            except RuntimeError as exc:  # a step size beyond float range: torch stops half-way through
                if snapshot is None or not is_overflow_error(exc):
                    raise
                nonfinite_weights = max(1, nonfinite_count(params))
            else:
                # an update can overflow even from finite gradients (a huge lr): take it back, or report it
                nonfinite_weights = nonfinite_count(params)
            if nonfinite_weights and snapshot is not None:
                snapshot.restore()
                rolled_back = True
            del snapshot
        optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1
        return {"train/grad_norm": float(grad_norm), "train/lr": lr,
                "train/skipped_step": 0.0 if finite and not rolled_back else 1.0,
                "train/nonfinite_weights": float(nonfinite_weights),
                "train/rolled_back_step": 1.0 if rolled_back else 0.0}

    def train_mini_batch(self, batch: Batch, norm: AggregationNorm) -> dict[str, float]:
        """One optimizer step on ``batch``: this rank's rows of a mini-batch whose global
        denominators are ``norm`` (from :func:`loongsage_core.algorithms.compute_norm` over all
        ranks' rows). Returns ``train/*`` metrics of the whole mini-batch, equal on every rank."""
        metrics = self.accumulate_gradients(batch, norm)
        metrics.update(self.optimizer_step())
        return metrics

    # ------------------------------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under Hugging Face names, floating ones in ``[model] dtype``; with
        ``[train] lora`` the adapter's tensors alone, under PEFT's names (what engines receive).

        Tied tensors are yielded once (under their first name); tensors already in the model
        dtype are the live parameters (detached, no copy), others are cast on the fly.
        """
        if self.peft_model is not None:
            for name, tensor in lora_lib.adapter_weights(self.peft_model):
                yield name, tensor.to(self.compute_dtype) if tensor.dtype != self.compute_dtype else tensor
            return
        seen: set[int] = set()
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            t = tensor.detach()
            if t.is_floating_point() and t.dtype != self.compute_dtype:
                t = t.to(self.compute_dtype)
            yield name, t

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy named tensors (Hugging Face names) into the model; returns how many were loaded."""
        state = self.model.state_dict(keep_vars=True)
        count = 0
        for name, tensor in weights:
            if name not in state:
                raise KeyError(f"TorchTrainWorker.load_weights: the model has no tensor named {name!r}")
            target = state[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"TorchTrainWorker.load_weights: {name!r} has shape {tuple(target.shape)}, "
                                 f"got {tuple(tensor.shape)}")
            target.data.copy_(tensor)
            count += 1
        return count

    # ------------------------------------------------------------------------------------------
    # Checkpoints and export
    # ------------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer, LR schedule, step and every rank's RNG states under directory ``path``.

        Rank 0 writes ``trainer_state.pt``; each rank writes ``rng_rank{rank}.pt``.
        """
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            state = {"format": CHECKPOINT_FORMAT, "role": self.role, "step": self.global_step,
                     "model": self._checkpoint_weights(),
                     "weights": ADAPTER_ONLY if self.peft_model is not None else "full",
                     "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                     "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
            _atomic_save(state, out / STATE_FILE)
        _atomic_save(capture_rng(), out / RNG_FILE.format(rank=self.rank))
        distributed.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, so training continues bit-identically.

        A rank without its own RNG file (the run was saved with fewer ranks) is reseeded from
        ``[run] seed``, rank and step instead.
        """
        src = Path(path)
        state_file = src / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"TorchTrainWorker.load_checkpoint: no {STATE_FILE} in checkpoint directory "
                                    f"'{src.resolve()}'")
        state = _load_file(state_file)
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"TorchTrainWorker.load_checkpoint: '{state_file}' has format {state.get('format')!r}, "
                             f"expected {CHECKPOINT_FORMAT}")
        self._load_checkpoint_weights(state, state_file)
        if self.optimizer is not None:
            if state["optimizer"] is None:
                raise ValueError(f"TorchTrainWorker.load_checkpoint: '{state_file}' holds no optimizer state "
                                 f"(saved by a {state.get('role')!r} worker)")
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["step"])
        rng_file = src / RNG_FILE.format(rank=self.rank)
        if rng_file.is_file():
            restore_rng(_load_file(rng_file))
        else:
            seed_everything(int(self.job.run.seed) + self.rank + 1_000_003 * self.global_step)
        distributed.barrier()

    def _checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The model entry of a checkpoint: every tensor, or with LoRA the trainable adapter alone."""
        if self.peft_model is None:
            return self.model.state_dict()
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def _load_checkpoint_weights(self, state: dict[str, Any], state_file: Path) -> None:
        """Load a checkpoint's model entry; a LoRA checkpoint fits only a LoRA policy and back."""
        kind = state.get("weights", "full")
        mine = ADAPTER_ONLY if self.peft_model is not None else "full"
        if kind != mine:
            raise ValueError(f"TorchTrainWorker.load_checkpoint: '{state_file}' holds {kind} weights but this "
                             f"policy {'trains a LoRA adapter' if mine == ADAPTER_ONLY else 'has no LoRA adapter'} "
                             "([train] lora differs from the run that saved it)")
        try:
            if self.peft_model is None:
                self.model.load_state_dict(state["model"])
                return
            expected = {name for name, p in self.model.named_parameters() if p.requires_grad}
            if set(state["model"]) != expected:
                missing, extra = sorted(expected - set(state["model"])), sorted(set(state["model"]) - expected)
                raise RuntimeError(f"adapter tensors missing: {missing[:3]}, unexpected: {extra[:3]}")
            self.model.load_state_dict(state["model"], strict=False)
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"TorchTrainWorker.load_checkpoint: '{state_file}' does not fit the model: "
                             f"{str(exc).strip().splitlines()[0]}") from None

    def save_adapter(self, path: str) -> None:
        """Write the PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
        on rank 0; ``peft.PeftModel.from_pretrained(base_model, path)`` loads it."""
        if self.peft_model is None:
            raise RuntimeError("TorchTrainWorker.save_adapter: the policy has no LoRA adapter ([train] lora)")
        if self.rank == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            lora_lib.save_adapter(self.peft_model, path)
        distributed.barrier()

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face directory (config.json, model.safetensors, tokenizer files) on rank 0.

        Weights are saved in ``[model] dtype`` (with LoRA: the base weights with the adapter merged
        in); the tokenizer is copied when the job names one.
        ``transformers.AutoModelForCausalLM.from_pretrained(path)`` (and ``[model] path``) load it.
        """
        if self.rank == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            weights = (self.model.state_dict() if self.peft_model is None
                       else lora_lib.merged_state_dict(self.peft_model, lora_lib.lora_scaling(self.lora)))
            state = {name: t.to(self.compute_dtype) if t.is_floating_point() else t
                     for name, t in weights.items()}
            saved_dtype = getattr(self.model.config, "dtype", None)
            self.model.config.dtype = self.compute_dtype
            try:
                self.model.save_pretrained(str(out), state_dict=state)
            finally:
                self.model.config.dtype = saved_dtype
            if self.job.model.tokenizer or self.job.model.path:
                load_tokenizer(self.job).save_pretrained(str(out))
        distributed.barrier()

    # ------------------------------------------------------------------------------------------
    # Placement
    # ------------------------------------------------------------------------------------------

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to the CPU (frees the accelerator)."""
        self._move(torch.device("cpu"))
        self._offloaded = self.device.type != "cpu"
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Move everything :meth:`offload` moved back to the worker's device."""
        self._move(self.device)
        self._offloaded = False

    def _move(self, device: torch.device) -> None:
        if self.device.type == "cpu":
            return
        self.model.to(device)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def close(self) -> None:
        """Leave the process group (if this worker joined one)."""
        import torch.distributed as dist

        if self.optimizer is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _load_file(path: Path) -> Any:
    """``torch.load`` of a checkpoint file; an unreadable one is a ``ValueError`` naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, empty file, pickle errors: all say "this file is broken"
        raise ValueError(f"checkpoint file '{path}' cannot be read ({type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'empty'})") from None
