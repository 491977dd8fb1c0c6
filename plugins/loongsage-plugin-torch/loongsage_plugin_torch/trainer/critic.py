"""The critic of the torch train backend (``TrainWorkerContext.role == "critic"``).

:class:`ValueModel` is the policy's transformer backbone (the base model of the causal LM that
``[critic] path`` names, by default the policy's own checkpoint) plus ``value_head``, a
``Linear(hidden, 1)`` that starts at zero, so a fresh critic predicts 0 everywhere and the first
GAE advantages are the plain returns.

Alignment: values are aligned with the tokens exactly like log-probs (``loongsage_hookspecs.records``).
``values[:, t]`` is the value head applied to the hidden state at position ``t - 1``, the state in
which token ``t`` is chosen (it has seen ``input_ids[:, :t]``), and estimates the return from token
``t`` onwards, ``G_t = r_t + gamma * G_next`` over trained tokens. Position 0 and padding hold 0.
That is what ``gae`` of loongsage-plugin-rl expects: ``delta_t = r_t + gamma * V_next - V_t`` with
``V_next`` the value at the row's next trained token (0 after the last one), ``returns = A + V``.

:class:`TorchCriticWorker` shares the optimizer step, checkpoint format, weight access and
offloading of :class:`~loongsage_plugin_torch.trainer.worker.TorchTrainWorker` and replaces the
model, the forward pass (``{"values": [B, T]}``) and the loss (:func:`.value_loss.clipped_value_loss`).
``[critic]`` settings (lr, batch sizes, value clip, loss coefficient) override ``[train]``'s;
``[train] backend_args`` (device, master weights, ...) apply to the critic too.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from loongsage_core.backend_api.loss import MetricAccumulator
from loongsage_hookspecs import AggregationNorm, Batch, ComponentRef, TrainWorkerContext

from ..modeling import load_model
from . import distributed
from .checkpoint import capture_rng
from .checkpoint_io import CHECKPOINT_FORMAT, RNG_FILE, STATE_FILE, atomic_save, load_checkpoint_file
from .logits import decoder_of
from .packing import PackedRows
from .value_loss import clipped_value_loss
from .worker import TorchTrainWorker, enable_gradient_checkpointing

VALUE_HEAD_FILE = "value_head.safetensors"


def critic_model_job(job: Any) -> Any:
    """``job`` with ``[model] path`` replaced by ``[critic] path`` when one is set."""
    if not job.critic.path:
        return job
    return attrs.evolve(job, model=attrs.evolve(job.model, path=job.critic.path))


def hidden_size_of(model: Any) -> int:
    """The width of the last hidden states of a transformers causal LM."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "hidden_size", None)
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"critic: cannot find hidden_size in the {type(config).__name__} of the critic model")
    return size


class ValueModel(torch.nn.Module):
    """A transformer backbone and a scalar value head; see the module docstring for the alignment."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | dict[str, torch.Tensor] | None, *,
                compute_dtype: torch.dtype, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 values ``[B, T]``: ``values[:, t] = head(hidden[:, t - 1])``, ``values[:, 0] = 0``.

        The backbone runs under autocast when its parameters are wider than ``compute_dtype``;
        the head always runs in float32.
        """
        hidden = self.hidden(input_ids, attention_mask, compute_dtype=compute_dtype, position_ids=position_ids)
        return torch.nn.functional.pad(self.head(hidden[:, :-1]), (1, 0))

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | dict[str, torch.Tensor] | None, *,
               compute_dtype: torch.dtype, position_ids: torch.Tensor | None = None,
               **attention_kwargs: Any) -> torch.Tensor:
        """The backbone's last hidden states ``[B, T, H]`` (under autocast, see :meth:`forward`);
        ``attention_kwargs`` reach every layer's attention (:meth:`.packing.PackedRows.attention`)."""
        param_dtype = self.value_head.weight.dtype
        autocast = (torch.autocast(device_type=input_ids.device.type, dtype=compute_dtype)
                    if compute_dtype != param_dtype else contextlib.nullcontext())
        with autocast:
            extra = {} if position_ids is None else {"position_ids": position_ids}  # packed rows
            return self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False, **extra, **attention_kwargs).last_hidden_state

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The value head in float32 over ``hidden`` ``[..., H]``: values ``[...]``."""
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            head = self.value_head
            return torch.nn.functional.linear(hidden.float(), head.weight.float(), head.bias.float()).squeeze(-1)


class TorchCriticWorker(TorchTrainWorker):
    """One data-parallel rank of the critic (role ``"critic"``) of the torch train backend."""

    def __init__(self, ctx: TrainWorkerContext) -> None:
        # builds its own model and loss; the rank setup and the optimizer are TorchTrainWorker's
        job = ctx.job
        if ctx.role != "critic":
            raise ValueError(f"TorchCriticWorker: role must be 'critic', got {ctx.role!r}")
        crit, train = job.critic, job.train
        if crit.value_clip < 0:
            raise ValueError(f"[critic] value_clip must be >= 0 (0 disables clipping), got {crit.value_clip}")
        self._init_rank(ctx, micro_batch_size=crit.micro_batch_size or train.micro_batch_size, section="critic",
                        trainable=True, training="train a critic")
        self.value_clip = float(crit.value_clip)
        self.loss_coef = float(crit.loss_coef)

        lm: Any = load_model(critic_model_job(job))
        backbone = decoder_of(lm)
        if train.gradient_checkpointing:
            enable_gradient_checkpointing(backbone)
        param_dtype = torch.float32 if self.options.master_weights == "float32" else self.compute_dtype
        model = ValueModel(backbone, hidden_size_of(lm))
        model.backbone.to(device=self.device, dtype=param_dtype)
        model.value_head.to(device=self.device, dtype=torch.float32)
        self.model: Any = model
        self.lora = None  # the critic trains all of its weights: no adapter, full checkpoints
        self.peft_model: Any = None
        del lm
        if distributed.is_distributed():
            distributed.broadcast_parameters(self.model.state_dict().values())

        alg = job.algorithm
        if ctx.components is None:
            raise ValueError("TorchCriticWorker: the context has no component registry to find the "
                             f"loss aggregation '{alg.loss_agg}' in")
        self.aggregation = ctx.components.bind(ComponentRef("loss_aggregation", alg.loss_agg, alg.loss_agg_args,
                                                            where=f"{ctx.where}: algorithm.loss_agg",
                                                            args_where=f"{ctx.where}: algorithm.loss_agg_args"))
        self._init_optimizer(self.model.parameters(), lr=crit.lr or train.lr)
        self.pipeline = None
        self.training_forward_logprobs = None  # a critic computes no log-probs to reuse
        self.global_step = 0
        self._offloaded = False
        self.model.train()

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    def _model_config(self) -> Any:
        return getattr(self.model.backbone, "config", None)

    def _values(self, micro: Batch) -> torch.Tensor:
        """Values ``[b, T]`` of one micro-batch (0 on padding; columns past its longest row not computed).

        When rows share a prompt (:meth:`_prompt_groups`) the prompt runs once and only the values
        at the ``loss_mask`` tokens are computed (0 elsewhere): the only ones GAE, the value loss
        and the host read."""
        ids = micro["input_ids"]
        attention = micro.get("attention_mask")
        if attention is None:
            attention = torch.ones_like(ids)
        loss_mask = micro.get("loss_mask")
        one_row = bool(self.max_tokens_per_micro_batch)
        groups = None
        if loss_mask is not None and bool(attention.any()):
            groups = self._prompt_groups(ids, attention, loss_mask > 0, one_row=one_row)
        if groups is not None or (one_row and bool(attention.any())):  # shared prompts, padding-free (.packing)
            packed = PackedRows(ids, attention, groups, one_row=one_row)
            with packed.attention(self._model_config()) as (mask, attention_kwargs):
                hidden = self.model.hidden(packed.input_ids, mask, compute_dtype=self.compute_dtype,
                                           position_ids=packed.position_ids, **attention_kwargs)
            wanted = (attention > 0) if groups is None else (loss_mask > 0) & (attention > 0)
            states, rows, cols = packed.predicting_states(hidden, wanted)
            values = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
            values = values.index_put((rows, cols), self.model.head(states))
            return values
        full_width = ids.shape[1]
        width = max(int(attention.sum(dim=1).max()) if ids.shape[0] else 0, 1)
        values = self.model(ids[:, :width], attention[:, :width], compute_dtype=self.compute_dtype)
        values = torch.where(attention[:, :width] > 0, values, torch.zeros_like(values))
        if width < full_width:
            values = torch.nn.functional.pad(values, (0, full_width - width))
        return values

    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``values`` ``[B, T]`` (float32, on the CPU, no gradient), aligned like log-probs."""
        return self._forward_chunks(batch, ("values",), lambda micro: {"values": self._values(micro)})

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------

    def _require_trainable(self, what: str) -> tuple[torch.optim.Optimizer, Any]:
        if self._offloaded:
            raise RuntimeError(f"TorchCriticWorker.{what}: the worker is offloaded; call onload() first")
        assert self.optimizer is not None  # a critic is always trainable
        return self.optimizer, None

    def _aggregate(self, loss: torch.Tensor, mask: torch.Tensor, norm: AggregationNorm) -> torch.Tensor:
        return self.aggregation(loss, mask, norm)

    def accumulate_gradients(self, batch: Batch, norm: AggregationNorm, *,
                             pipeline: Any = None) -> dict[str, float]:
        """Forward and backward of ``loss_coef * clipped value loss`` over ``batch`` in micro-batches.

        ``batch`` needs ``values`` (the critic's values when the rows were collected) and
        ``returns`` (the targets from the advantage estimator). Returns ``train/critic_loss``,
        ``train/value_mean`` and ``train/value_clip_frac`` of the whole mini-batch (all ranks).
        The critic's loss is its value loss: a policy ``pipeline`` is refused.
        """
        if pipeline is not None:
            raise ValueError("TorchCriticWorker.accumulate_gradients: the critic trains its value loss, not a "
                             "policy loss pipeline")
        self._require_trainable("accumulate_gradients")
        for key in ("values", "returns", "loss_mask"):
            if key not in batch:
                have = ", ".join(sorted(batch.tensors)) or "none"
                raise KeyError(f"TorchCriticWorker.train_mini_batch: the batch has no {key!r} tensor "
                               f"(the critic trains on rollout-time values and the advantage's returns); "
                               f"it has: {have}")
        self.model.train()
        acc = MetricAccumulator()
        for rows in self._micro_batch_rows(batch, self.micro_batch_size):
            micro = self._to_device(batch.select(rows))
            values = self._values(micro)
            loss, metrics = clipped_value_loss(values, micro["values"], micro["returns"], micro["loss_mask"], norm,
                                               clip=self.value_clip, aggregate=self._aggregate)
            (self.loss_coef * loss).backward()
            acc.add(metrics, micro["loss_mask"])
        return self._finish_accumulation(acc)

    def optimizer_step(self, *, hyperparameters: Mapping[str, float] | None = None) -> dict[str, float]:
        """The policy's optimizer step (clip, AdamW, schedule); metrics named ``train/critic_*``."""
        out = super().optimizer_step(hyperparameters=hyperparameters)
        return {k.replace("train/", "train/critic_", 1): v for k, v in out.items()}

    # ------------------------------------------------------------------------------------------
    # Checkpoints and export
    # ------------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        """Save value model, optimizer, LR schedule, step and this rank's RNG state under ``path``.

        Unlike the policy's layout (state on rank 0 only), every critic rank writes the whole
        state (the replicas are identical) into its own directory, so each ``critic_rank_<r>/`` of a
        controller checkpoint is self-contained and rank ``r`` resumes from its own directory.
        """
        assert self.optimizer is not None  # a critic is always trainable
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = {"format": CHECKPOINT_FORMAT, "role": self.role, "step": self.global_step,
                 "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict()}
        atomic_save(state, out / STATE_FILE)
        atomic_save(capture_rng(), out / RNG_FILE.format(rank=self.rank))
        distributed.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore a critic checkpoint (refusing one written by a policy or reference worker)."""
        state_file = Path(path) / STATE_FILE
        if state_file.is_file():
            state = load_checkpoint_file(state_file)
            role = state.get("role") if isinstance(state, dict) else None
            if role != "critic":
                raise ValueError(f"TorchCriticWorker.load_checkpoint: '{state_file}' was saved by a {role!r} "
                                 "worker, not a critic")
        super().load_checkpoint(path)

    def save_hf(self, path: str) -> None:
        """Write the backbone as a Hugging Face directory (``AutoModel`` loads it) and the value head
        as ``value_head.safetensors`` (``weight`` ``[1, hidden]``, ``bias`` ``[1]``), on rank 0."""
        if self.rank == 0:
            from safetensors.torch import save_file

            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            backbone = self.model.backbone
            state = {n: t.to(self.compute_dtype) if t.is_floating_point() else t
                     for n, t in backbone.state_dict().items()}
            saved_dtype = getattr(backbone.config, "dtype", None)
            backbone.config.dtype = self.compute_dtype
            try:
                backbone.save_pretrained(str(out), state_dict=state)
            finally:
                backbone.config.dtype = saved_dtype
            head = {n: t.detach().float().contiguous().cpu() for n, t in self.model.value_head.state_dict().items()}
            save_file(head, str(out / VALUE_HEAD_FILE))
        distributed.barrier()
