"""``TorchTrainWorker``: one data-parallel rank of the embedded PyTorch trainer.

The model is a ``transformers`` causal LM loaded by :func:`loongsage_plugin_torch.modeling.load_model`
(identical on every rank: same seed, then a broadcast from rank 0). A mini-batch is split into
micro-batches of ``[train] micro_batch_size`` rows; each micro-batch loss comes from the host's
:class:`~loongsage_core.algorithms.LossPipeline` already divided by the mini-batch's global norm,
so gradients add up across micro-batches and ranks (summed with ``torch.distributed``), then one
AdamW step follows.

``[train] backend_args`` of this backend: see :mod:`.backend_options`.

With ``[train] lora`` the policy is wrapped in a PEFT LoRA adapter (:mod:`..lora`): only the
adapter trains; checkpoints hold the adapter and its optimizer state (the base weights are
reloaded from ``[model]``); :meth:`TorchTrainWorker.named_weights` yields the adapter alone (what
the weight transports send); :meth:`TorchTrainWorker.reference_forward` scores with the adapter
disabled, so a KL reference needs no second copy of the weights; :meth:`TorchTrainWorker.save_hf`
writes the merged model and :meth:`TorchTrainWorker.save_adapter` the PEFT adapter directory.

The worker is assembled from mixins, one concern per module, so that each reads on its own:
:mod:`.forward_passes` (log-probs, entropies, the KL reference), :mod:`.training_step` (gradients,
the AdamW step and its rollback; it builds on the forward passes), :mod:`.weight_io` (weights for
transports and reference updates, Hugging Face and adapter exports), :mod:`.checkpoint_io` (the
checkpoint directory), :mod:`.placement` (offload, onload, close) and :mod:`.router_replay` (a
mixture-of-experts policy routing as the engine did). This module builds the
model and the rank; the critic (:mod:`.critic`) subclasses the worker.
"""

from __future__ import annotations

from typing import Any

import torch

from loongsage_core.backend_api.loss import LossPipeline
from loongsage_hookspecs import TrainWorkerContext

from .. import lora as lora_lib
from ..modeling import load_model, load_tokenizer, tokenizer_path, torch_dtype
from . import distributed
from .backend_options import BackendOptions, resolve_device
from .checkpoint import seed_everything
from .checkpoint_io import CheckpointMixin
from .grammar_replay import GrammarReplay
from .placement import PlacementMixin
from .router_replay import RouterReplay
from .training_step import TrainingStepMixin
from .vision_inputs import VisionBatchInputs
from .weight_io import WeightIOMixin


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute activations in the backward pass (non-reentrant), in either transformers naming."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x naming
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class TorchTrainWorker(TrainingStepMixin, WeightIOMixin, CheckpointMixin, PlacementMixin):
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
        # a vision-language policy rebuilds each row's image inputs from the record (.vision_inputs)
        self.vision_inputs = VisionBatchInputs.for_model(
            model, tokenizer_path(job) if (job.model.tokenizer or job.model.path) else None)
        # a mixture-of-experts policy replays the engine's routing ([algorithm] router_replay)
        algorithm = job.algorithm
        self.router_replay = RouterReplay(model) if algorithm.router_replay else None
        self.router_replay_compare = trainable and self.router_replay is not None and algorithm.router_replay_compare
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
        if ctx.components is None:
            raise ValueError("torch train backend: the context has no component registry to bind the job's loss "
                             "components with")
        self.pipeline = LossPipeline.from_job(job, ctx.components)
        self._init_optimizer([p for p in self.model.parameters() if p.requires_grad], lr=job.train.lr)
        self.model.train()

    def _init_rank(self, ctx: TrainWorkerContext, *, micro_batch_size: int, section: str, trainable: bool,
                   training: str) -> None:
        """What every rank of the backend sets up alike (policy, reference and critic): its place in
        the group, the ``[train] backend_args`` options, batch sizes, device and dtype, the
        process group of a trainable data-parallel role, and the seed."""
        job = ctx.job
        self.job = job
        self.grammar_replay = GrammarReplay(lambda: load_tokenizer(job))
        self.role = ctx.role
        self.rank = int(ctx.rank)
        self.world_size = int(ctx.world_size)
        self.options = BackendOptions.from_args(dict(job.train.backend_args))
        if micro_batch_size < 1:
            raise ValueError(f"[{section}] micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = job.train.max_tokens_per_micro_batch
        self.share_prompts = self.options.share_prompts
        self.prompt_tokens = (0, 0)
        self.forward_micro_batch_size = self.options.forward_micro_batch_size or self.micro_batch_size
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
