"""``MegatronTrainWorker``: one rank of the Megatron-Core train backend.

The policy is a Megatron-Core ``GPTModel`` built by Megatron-Bridge from the Hugging Face
directory ``[model] path`` (weights converted on load, converted back by :meth:`named_weights`
and :meth:`save_hf`). Losses come from the host's
:class:`~loongsage_core.algorithms.LossPipeline`, already divided by the mini-batch's global
norm, so gradients add up across micro-batches and data-parallel ranks.

Training is Megatron-Core's own. The micro-batches run through
``megatron.core.pipeline_parallel.get_forward_backward_func()`` (see :mod:`.forward_backward`):
no pipelining under PP = 1, the 1F1B schedule (``forward_backward_pipelining_without_interleaving``)
under PP > 1, where each rank holds one pipeline stage (its share of the layers; the first
stage the embedding, the last the final norm and output layer, built by Megatron-Bridge with
``pre_process`` / ``post_process``) and the last stage computes the loss on each micro-batch's
logits. The model config sets ``calculate_per_token_loss`` and the loss function returns
Megatron's ``(loss, num_tokens, info)`` triple, so Megatron back-propagates the host's loss as it
is (no division by the number of micro-batches or tokens) and sums rather than averages
data-parallel gradients. The actor's model is wrapped in
``megatron.core.distributed.DistributedDataParallel`` (gradients accumulate in its contiguous
buffers; ``finalize_model_grads`` sums them over the data-parallel group, sums the
tensor-parallel partial gradients of replicated norms and, under PP > 1, the gradients of the
tied embedding's copies on the first and last stage), and the optimizer is
``megatron.core.optimizer.get_megatron_optimizer`` with Adam (decoupled weight decay on every
parameter, like the torch backend), which computes the gradient norm over the tensor- and
pipeline-parallel shards and clips to ``[train] grad_clip`` inside its ``step()``. The learning
rate follows the ``[train]`` schedule of the torch backend (a ``LambdaLR`` on the torch optimizer
inside the Megatron one). A step whose gradients are not finite is skipped
(``train/skipped_step`` = 1), as in the torch backend.

Every rank returns the same results: :meth:`forward` broadcasts the last stage's log-probs and
entropies over the pipeline group, training metrics are reported by the last stage's
tensor-parallel rank 0 of each data-parallel rank and all-reduced, and :meth:`named_weights`
gathers full weights from every stage (Megatron-Bridge's export). The ranks of one
model-parallel group (its ``tp * pp`` ranks) must be given the same rows; a clear error says
so otherwise.

Mixture-of-Experts models (a Hugging Face config naming routed experts, e.g. ``qwen3_moe``) are
built with Megatron-Core's MoE layers. Under expert parallelism (``ep`` > 1) each rank holds
``num_experts / ep`` of every MoE layer's experts; an expert-parallel group is made of ``ep``
data-parallel ranks, which hold different rows, so its MoE layers exchange tokens between them
(the bridge's ``alltoall`` dispatcher on CUDA, ``allgather`` on the CPU). Those ranks must all
call :meth:`forward` / :meth:`train_mini_batch` together; they agree on one micro-batch shape
and count (a rank short of rows runs all-padding micro-batches, which add no loss). Expert
gradients are summed over the expert-data-parallel group (``dp / ep`` ranks) by Megatron DDP's
expert buffers, dense ones over the data-parallel group, so a step equals EP = 1's on the same
global batch. Megatron-Bridge's expert renaming is extended to Megatron-Core's ``SequentialMLP``
(:mod:`.bridge_compat`), so each rank loads and exports its own experts. The MoE load-balancing
(auxiliary) loss is off by default (``moe_aux_loss_coeff = 0``): the gradient is the host's RL
loss's exactly. With a positive coefficient Megatron adds the gradient of ``coeff`` times every
MoE layer's load-balancing loss, averaged over the mini-batch's routed tokens (all
micro-batches and data-parallel ranks); the reported ``train/loss`` stays the RL loss.

``[train] backend_args`` of this backend:

* ``tp``: tensor-parallel size (default 1); ``pp``: pipeline-parallel size (default 1; the
  model's layers must split evenly over the stages);
* ``dp``: data-parallel size (default ``world_size // (tp * pp)``; ``tp * pp * dp`` must equal
  the number of ranks);
* ``dist_backend``: ``"auto"`` (NCCL on CUDA, Gloo on CPU), ``"gloo"`` or ``"nccl"``;
* ``use_distributed_optimizer``: shard the optimizer state over the data-parallel group with
  Megatron-Core's ``DistributedOptimizer`` (default false; needs CUDA, a clear error otherwise);
* ``ep``: expert-parallel size (default 1; MoE models only; must divide ``dp`` and the number
  of experts); MoE models need ``tp = 1`` (Megatron-Core's MoE layers train under tensor
  parallelism only with sequence parallelism, which this backend does not use yet);
* ``moe_aux_loss_coeff``: weight of the MoE load-balancing loss (default 0: off).

The ``reference`` role is forward-only (no DDP wrapper, no optimizer): the frozen reference
model beside the policy, and the model of the ``megatron`` distillation teacher
(:mod:`.teacher`), which builds one in the controller process (TP = PP = EP = 1) and reads
:meth:`MegatronTrainWorker.score`: the sampled tokens' log-probs, top-k log-probs and full
logits in the layout of ``loongsage_hookspecs.TeacherOutputs``.

Checkpoints hold, per rank, the model shard, the Megatron optimizer's ``state_dict()`` (plus
its parameter state file, ``save_parameter_state``, under the distributed optimizer), the
schedule, the step and the RNG state; a resumed run continues exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import attrs
import torch

from loongsage_core.backend_api import LossPipeline, MetricAccumulator, structure_args
from loongsage_hookspecs import AggregationNorm, Batch

from . import bridge_compat, cpu_compat

STATE_FILE = "megatron_state_rank{rank}.pt"
# The distributed optimizer's parameter state, written by data-parallel rank 0 of each model-parallel rank.
PARAM_STATE_FILE = "megatron_optimizer_params_mp{rank}.pt"
CHECKPOINT_FORMAT = 2


@attrs.define(frozen=True)
class BackendOptions:
    """The validated ``[train] backend_args`` of the megatron backend (see the module docstring)."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    dist_backend: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "gloo", "nccl")))
    use_distributed_optimizer: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    ep: int = 1
    moe_aux_loss_coeff: float = attrs.field(default=0.0, converter=float, validator=attrs.validators.ge(0.0))

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "BackendOptions":
        return structure_args(cls, args, "[train] backend_args", "megatron backend")


def parallel_sizes(options: BackendOptions, world_size: int,
                   num_experts: int | None = None) -> tuple[int, int, int, int]:
    """``(tp, pp, dp, ep)`` for ``world_size`` ranks; raises ValueError naming the bad backend_args.

    ``num_experts`` is the model's number of routed experts (None for a dense model). Megatron-Core
    forms each expert-parallel group from data-parallel ranks (of one tensor-parallel slice), so
    ``ep`` must divide ``dp``; it must also divide the number of experts (each rank holds an equal
    share of every MoE layer's experts).
    """
    tp, pp, ep = int(options.tp), int(options.pp), int(options.ep)
    if tp < 1 or pp < 1:
        raise ValueError(f"[train] backend_args: tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if world_size % (tp * pp):
        raise ValueError(f"[train] backend_args: {world_size} ranks are not divisible by tp * pp = {tp * pp}")
    dp = world_size // (tp * pp) if options.dp is None else int(options.dp)
    if tp * pp * dp != world_size:
        raise ValueError(f"[train] backend_args: tp * pp * dp = {tp}*{pp}*{dp} != {world_size} ranks")
    if ep < 1:
        raise ValueError(f"[train] backend_args.ep must be >= 1, got {ep}")
    if ep > 1 and not num_experts:
        raise ValueError(f"[train] backend_args.ep = {ep}: expert parallelism needs a Mixture-of-Experts model, "
                         "but the model in [model] path is dense (its config.json names no experts); set ep = 1")
    if dp % ep:
        raise ValueError(f"[train] backend_args.ep = {ep} must divide the data-parallel size dp = {dp} "
                         "(Megatron-Core forms expert-parallel groups from data-parallel ranks)")
    if num_experts and num_experts % ep:
        raise ValueError(f"[train] backend_args.ep = {ep} must divide the model's {num_experts} experts "
                         "(every expert-parallel rank holds an equal share)")
    return tp, pp, dp, ep


class MegatronTrainWorker:
    """One rank of the megatron train backend (implements ``loongsage_hookspecs.TrainWorker``)."""

    def __init__(self, ctx: Any) -> None:
        job = ctx.job
        if ctx.role not in ("actor", "reference"):
            raise ValueError(f"megatron train backend: role {ctx.role!r} is not supported (actor, reference)")
        if not job.model.path:
            raise ValueError("megatron train backend: [model] path must name a Hugging Face directory "
                             "(Megatron-Bridge converts it)")
        if job.model.dtype != "float32":
            raise ValueError(f"megatron train backend: [model] dtype = {job.model.dtype!r} is not supported yet "
                             "(float32 only)")
        if job.train.micro_batch_size < 1:
            raise ValueError(f"[train] micro_batch_size must be >= 1, got {job.train.micro_batch_size}")
        self.job, self.role = job, ctx.role
        self.rank, self.world_size = int(ctx.rank), int(ctx.world_size)
        if ctx.role == "reference":
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                # built beside the policy in its actor: the same ranks, sharded the same way
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.options = BackendOptions.from_args(dict(job.train.backend_args))
        self.model_path = job.resolve_path(job.model.path) if hasattr(job, "resolve_path") else job.model.path
        config_file = Path(self.model_path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"[model] path: no config.json in model directory '{self.model_path}'")
        hf_config = _hf_config(config_file)
        self.num_experts = _hf_num_experts(hf_config)
        self.tp, self.pp, self.dp, self.ep = parallel_sizes(self.options, self.world_size, self.num_experts)
        self.micro_batch_size = job.train.micro_batch_size
        if ctx.role == "actor" and self.options.use_distributed_optimizer:
            blocker = cpu_compat.distributed_optimizer_blocker()
            if blocker:
                raise ValueError(f"[train] backend_args.use_distributed_optimizer = true cannot run here: {blocker}; "
                                 "set it to false (the optimizer state is then replicated on each rank)")
        layers = hf_config.get("num_hidden_layers")
        if isinstance(layers, int) and layers % self.pp:
            raise ValueError(f"[train] backend_args.pp = {self.pp}: the model's {layers} layers do not split evenly "
                             "over the pipeline stages")
        if self.num_experts and self.tp > 1:
            # Megatron-Core's MoELayer refuses to train under tensor parallelism without sequence
            # parallelism, which this backend does not use (its inputs are whole sequences per rank).
            raise ValueError(f"[train] backend_args.tp = {self.tp}: Mixture-of-Experts models need tp = 1 in the "
                             "megatron backend (Megatron-Core's MoE layers need sequence parallelism under "
                             "tensor parallelism, not supported yet); use ep and dp instead")
        if self.options.moe_aux_loss_coeff and not self.num_experts:
            raise ValueError(f"[train] backend_args.moe_aux_loss_coeff = {self.options.moe_aux_loss_coeff}: the model "
                             "in [model] path is dense (no MoE load-balancing loss)")

        auto_bridge = cpu_compat.import_bridge()
        bridge_compat.apply()
        cpu_compat.apply()
        self._init_parallel(ctx)
        cpu_compat.init_rng_tracker(int(job.run.seed))
        self.device = torch.device("cpu") if cpu_compat.cuda_missing() else torch.device(
            "cuda", torch.cuda.current_device())

        # ``torch_dtype`` (the bridge's own argument), not ``dtype``: other keywords are kept for
        # loading the tokenizer and config, whose save_pretrained in save_hf cannot serialise a dtype.
        self.bridge = auto_bridge.from_hf_pretrained(self.model_path, torch_dtype=torch.float32)
        provider = self.bridge.to_megatron_provider(load_weights=True)
        # Megatron-Bridge turns initialization off when it loads weights, but Megatron-Core marks a
        # tensor-parallel shard (``tensor_model_parallel``, partition dim) only while initializing
        # it; unmarked shards would count as replicas in the optimizer's gradient norm under TP > 1.
        # Initialize (cheap next to training), then the bridge's load overwrites the values.
        provider.perform_initialization = True
        provider.tensor_model_parallel_size = self.tp
        provider.pipeline_model_parallel_size = self.pp
        provider.expert_model_parallel_size = self.ep
        provider.params_dtype = torch.float32
        provider.bf16 = provider.fp16 = False
        provider.hidden_dropout = provider.attention_dropout = 0.0
        provider.sequence_parallel = False
        # The host's loss is already divided by the mini-batch's global norm: Megatron DDP must sum
        # the data-parallel gradients (gradient scaling factor 1), not average them.
        provider.calculate_per_token_loss = True
        if self.num_experts:
            self._configure_moe(provider, hf_config)
        cpu_compat.configure_provider(provider)
        provider.finalize()
        # The Hugging Face vocabulary (Megatron may pad its output layer beyond it).
        self.vocab_size = int(provider.vocab_size)
        # Unwrapped model chunks (what Megatron-Bridge converts to and from Hugging Face names).
        self.modules = provider.provide_distributed_model(
            wrap_with_ddp=False, use_cpu_initialization=self.device.type == "cpu", mixed_precision_wrapper=None)

        self.global_step = 0
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.pipeline: LossPipeline | None = None
        self._offloaded = False
        self._param_backup: dict[torch.nn.Parameter, torch.Tensor] = {}
        if self.role != "actor":
            self.chunks: list[Any] = list(self.modules)
            self.model = self.chunks[0]
            self.model.requires_grad_(False)
            self.model.eval()
            return
        self.pipeline = LossPipeline(job, ctx.components)
        self.chunks = self._wrap_ddp(self.modules)
        self.model = self.chunks[0]
        self.optimizer, self.scheduler = self._build_optimizer()
        self.model.train()

    # ------------------------------------------------------------------------------------------

    def _init_parallel(self, ctx: Any) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        if not dist.is_initialized():
            backend = self.options.dist_backend
            if backend == "auto":
                backend = "gloo" if cpu_compat.cuda_missing() else "nccl"
            port = int(ctx.master_port) or int(os.environ.get("MASTER_PORT", "0"))
            if self.world_size > 1 and not port:
                raise ValueError("megatron train backend: several ranks need ctx.master_port")
            init = f"tcp://{ctx.master_addr}:{port}" if port else f"file://{_tmp_rendezvous()}"
            dist.init_process_group(backend, init_method=init, rank=self.rank, world_size=self.world_size)
        if parallel_state.model_parallel_is_initialized():
            current = (parallel_state.get_tensor_model_parallel_world_size(),
                       parallel_state.get_pipeline_model_parallel_world_size(),
                       parallel_state.get_expert_model_parallel_world_size())
            if current == (self.tp, self.pp, self.ep):  # a second model of this process (the reference) shares it
                return
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp,
                                                 pipeline_model_parallel_size=self.pp,
                                                 expert_model_parallel_size=self.ep)

    def _configure_moe(self, provider: Any, hf_config: dict[str, Any]) -> None:
        """Mixture-of-Experts settings of the provider (expert parallelism is set with the other sizes).

        The load-balancing loss is off unless ``backend_args.moe_aux_loss_coeff`` > 0 (the
        bridge's default coefficient would add its gradient to the RL loss's); see
        :meth:`_aux_loss_scale` for how a positive coefficient is normalised.
        """
        if not provider.num_moe_experts:
            raise ValueError(f"[model] path: config.json names {self.num_experts} experts but Megatron-Bridge built "
                             "a dense model from it")
        provider.moe_aux_loss_coeff = float(self.options.moe_aux_loss_coeff)
        bridge_compat.configure_router(provider, hf_config)

    def _wrap_ddp(self, modules: list[Any]) -> list[Any]:
        """Wrap each model chunk in Megatron-Core's ``DistributedDataParallel`` (grad buffers, DP reduction)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=self.options.use_distributed_optimizer,
            overlap_grad_reduce=False, overlap_param_gather=False, average_in_collective=False)
        return [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m,
                                        disable_bucketing=index > 0)
                for index, m in enumerate(modules)]

    def _build_optimizer(self) -> tuple[Any, Any]:
        """Megatron-Core's Adam over the DDP chunks, and the ``[train]`` learning-rate schedule."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from .schedule import make_megatron_scheduler

        train = self.job.train
        if len(train.betas) != 2:
            raise ValueError(f"[train] betas must have two values, got {train.betas}")
        config = OptimizerConfig(
            optimizer="adam", lr=float(train.lr), min_lr=float(train.lr) * float(train.min_lr_ratio),
            weight_decay=float(train.weight_decay), adam_beta1=float(train.betas[0]),
            adam_beta2=float(train.betas[1]), adam_eps=float(train.eps), decoupled_weight_decay=True,
            clip_grad=float(train.grad_clip), fp16=False, bf16=False, params_dtype=torch.float32,
            use_distributed_optimizer=self.options.use_distributed_optimizer)
        # No overrides: every parameter decays like in the torch backend (Megatron's default
        # groups would exempt biases and norms, relying on its own scheduler for ``wd_mult``).
        optimizer = get_megatron_optimizer(config, self.chunks, config_overrides={})
        return optimizer, make_megatron_scheduler(optimizer, train)

    def _stage_inputs(self, batch: Batch) -> list[Any]:
        """The micro-batches of ``batch`` as model inputs.

        Under PP > 1 they share one fixed shape. Under EP > 1 every MoE layer exchanges tokens
        with the other ranks of its expert-parallel group, which hold other rows (they are
        data-parallel replicas): those ranks agree on one shape and one number of micro-batches
        (the largest of the group), a rank with fewer rows running all-padding micro-batches.
        """
        from .forward_backward import real_lengths, stage_inputs

        if self.ep == 1:
            return stage_inputs(batch, self.micro_batch_size, self.device, fixed_shape=self.pp > 1)
        import torch.distributed as dist
        from megatron.core import parallel_state

        rows = len(batch)
        width = int(real_lengths(batch).max()) if rows else 0
        count = -(-rows // self.micro_batch_size)
        agreed = torch.tensor([width, count], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())
        return stage_inputs(batch, self.micro_batch_size, self.device, fixed_shape=True,
                            width=int(agreed[0]), micro_batches=int(agreed[1]))

    def _aux_loss_scale(self, inputs: list[Any]) -> float:
        """The factor Megatron's per-micro-batch load-balancing loss gets under this backend's loss.

        With ``calculate_per_token_loss`` Megatron attaches each micro-batch's load-balancing
        loss times its number of routed tokens and expects ``finalize_model_grads`` to divide all
        gradients by the mini-batch's token count; this backend does not divide (the host's loss
        is normalised already). Scaling the coefficient by 1 / (tokens routed in the whole
        mini-batch, over all micro-batches and data-parallel ranks) gives the gradient of
        ``moe_aux_loss_coeff`` times the token-weighted mean load-balancing loss of every MoE layer.
        """
        import torch.distributed as dist
        from megatron.core import parallel_state

        tokens = torch.tensor([float(sum(i.input_ids.numel() for i in inputs))], dtype=torch.float64,
                              device=self.device)
        if dist.is_initialized() and self.dp > 1:
            dist.all_reduce(tokens, group=parallel_state.get_data_parallel_group())
        return 1.0 / max(float(tokens.item()), 1.0)

    def _check_same_rows(self, batch: Batch, caller: str) -> None:
        """Raise ValueError unless every rank of this rank's model-parallel group (its TP x PP
        ranks) got the same rows: they run one model together (under PP > 1 different micro-batch
        counts would hang the pipeline schedule)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.tp * self.pp == 1:
            return
        ids = batch["input_ids"]
        weights = torch.arange(1, ids.numel() + 1, dtype=torch.float64).view(ids.shape)
        mine = torch.tensor([float(ids.shape[0]), float(ids.shape[1]), float((ids.double() * weights).sum())],
                            dtype=torch.float64, device=self.device)
        group = parallel_state.get_model_parallel_group()
        seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(seen, mine, group=group)
        if any(not torch.equal(other, seen[0]) for other in seen):
            shapes = [f"{int(t[0])}x{int(t[1])}" for t in seen]
            raise ValueError(f"MegatronTrainWorker.{caller}: the {len(seen)} ranks of one model-parallel group "
                             f"(tp * pp = {self.tp}*{self.pp}) must receive the same rows (data parallelism "
                             f"splits rows over the {self.dp} data-parallel ranks only), but their input_ids "
                             f"differ (shapes by rank: {shapes})")

    @property
    def data_parallel_rank(self) -> int:
        """This rank's model replica: the controller gives every rank of one replica the same rows."""
        from megatron.core import parallel_state

        return int(parallel_state.get_data_parallel_rank())

    @property
    def data_parallel_size(self) -> int:
        return int(self.dp)

    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` ``[B, T]`` (float32, CPU, no gradient).

        Under PP > 1 the last pipeline stage computes them and broadcasts them to the other
        stages, so every rank returns them. Under EP > 1 every rank of an expert-parallel group
        must call it (with its own rows, possibly none): their MoE layers run together.
        """
        from .forward_backward import token_outputs

        if "input_ids" not in batch:
            raise KeyError("MegatronTrainWorker.forward: the batch has no 'input_ids' tensor")
        if self._offloaded:
            raise RuntimeError("MegatronTrainWorker.forward: the worker is offloaded; call onload() first")
        self._check_same_rows(batch, "forward")
        rows, width = batch["input_ids"].shape
        inputs = self._stage_inputs(batch)
        if not inputs:
            empty = torch.zeros(0, width)
            return {"logprobs": empty, "entropy": empty.clone()}
        outs = self._run_forward_only(
            inputs, lambda inputs, logits: token_outputs(logits, inputs, tp=self.tp, entropy_grad=False))
        if outs:
            both = torch.stack([torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])]).float()
        else:  # not the last pipeline stage: receive below
            both = torch.empty(2, rows, width, dtype=torch.float32, device=self.device)
        if self.pp > 1:
            _broadcast_from_last_stage(both)
        return {"logprobs": both[0].cpu(), "entropy": both[1].cpu()}

    @torch.no_grad()
    def score(self, batch: Batch, *, topk: int = 0, return_logits: bool = False,
              logits_dtype: torch.dtype = torch.float32,
              output_device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The model's next-token distributions over ``batch``, as a distillation teacher returns them.

        ``logprobs`` ``[B, T]`` of the batch's tokens; with ``topk`` > 0 ``topk_ids`` /
        ``topk_logprobs`` ``[B, T, topk]`` (largest first); with ``return_logits`` the raw
        ``logits`` ``[B, T, V]`` (``V`` the Hugging Face vocabulary) in ``logits_dtype``. Entry
        ``t`` describes the distribution that produced token ``t``; position 0 and padding hold 0
        (the layout of ``loongsage_hookspecs.TeacherOutputs``). Each micro-batch's outputs move to
        ``output_device`` as soon as they are computed, so full logits never pile up on the
        accelerator. Needs PP = 1 (the outputs are not broadcast from the last stage); under TP > 1
        the vocabulary shards are gathered. The ``megatron`` teacher (:mod:`.teacher`) calls it.
        """
        from .forward_backward import teacher_outputs

        if "input_ids" not in batch:
            raise KeyError("MegatronTrainWorker.score: the batch has no 'input_ids' tensor")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
            raise ValueError(f"MegatronTrainWorker.score: topk must be an integer >= 0, got {topk!r}")
        if topk > self.vocab_size:
            raise ValueError(f"MegatronTrainWorker.score: topk={topk} exceeds the vocabulary size {self.vocab_size}")
        if self.pp > 1:
            raise ValueError(f"MegatronTrainWorker.score: needs pp = 1, got pp = {self.pp} (only the last pipeline "
                             "stage has the logits)")
        if self._offloaded:
            raise RuntimeError("MegatronTrainWorker.score: the worker is offloaded; call onload() first")
        self._check_same_rows(batch, "score")
        device = torch.device(output_device)
        width = int(batch["input_ids"].shape[1])
        parts = self._run_forward_only(self._stage_inputs(batch), lambda inputs, logits: teacher_outputs(
            logits, inputs, tp=self.tp, vocab=self.vocab_size, topk=topk, return_logits=return_logits,
            logits_dtype=logits_dtype, device=device))
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"logprobs": ((), torch.float32)}
        if topk:
            shapes.update(topk_ids=((topk,), torch.long), topk_logprobs=((topk,), torch.float32))
        if return_logits:
            shapes["logits"] = ((self.vocab_size,), logits_dtype)
        return {key: torch.cat([part[key] for part in parts]) if parts
                else torch.zeros((0, width, *trailing), dtype=dtype, device=device)
                for key, (trailing, dtype) in shapes.items()}

    def _run_forward_only(self, inputs: list[Any], on_logits: Any) -> list[Any]:
        """``inputs`` through Megatron's schedule without gradient, every chunk in eval mode (no
        dropout) meanwhile; returns what ``on_logits(inputs, logits)`` returned per micro-batch on
        the last pipeline stage (``[]`` elsewhere or without inputs)."""
        from .forward_backward import run_schedule

        if not inputs:
            return []
        was_training = self.model.training
        for chunk in self.chunks:
            chunk.eval()
        try:
            return run_schedule(self.chunks, inputs, on_logits, forward_only=True)
        finally:
            for chunk in self.chunks:
                chunk.train(was_training)

    def train_mini_batch(self, batch: Batch, norm: AggregationNorm) -> dict[str, float]:
        """One optimizer step on this rank's rows of a mini-batch with global denominators ``norm``.

        The micro-batches go through Megatron-Core's forward-backward schedule (1F1B under
        PP > 1); the last pipeline stage computes the host's loss on each micro-batch's logits.
        Under EP > 1 every rank of an expert-parallel group must call it (see :meth:`forward`).
        """
        if self.optimizer is None or self.pipeline is None:
            raise RuntimeError(f"MegatronTrainWorker.train_mini_batch: the {self.role!r} worker is forward-only")
        if self.pipeline.needs_logits:
            raise ValueError("megatron train backend: vocabulary-level KL estimators (full logits) are not "
                             "supported yet")
        if self._offloaded:
            raise RuntimeError("MegatronTrainWorker.train_mini_batch: the worker is offloaded; call onload() first")
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        from .forward_backward import run_schedule, token_outputs

        self._check_same_rows(batch, "train_mini_batch")
        pipeline = self.pipeline
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)
        acc = MetricAccumulator()
        entropy_grad = pipeline.entropy_coef != 0.0
        # Every rank of a tensor-parallel group computes the same loss: one of them reports it.
        reports = _tensor_parallel_rank() == 0

        def loss(inputs: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            if not inputs.rows:  # an all-padding micro-batch (expert parallelism): no loss, same graph
                return logits.sum() * 0.0, torch.zeros((), dtype=torch.int), {}
            logprobs, entropy = token_outputs(logits, inputs, tp=self.tp, entropy_grad=entropy_grad)
            value, micro_metrics = pipeline.loss(inputs.micro, logprobs, entropy, norm)
            if reports:
                acc.add(micro_metrics, inputs.micro["loss_mask"])
            return value, inputs.micro["loss_mask"].sum().to(torch.int), {}

        inputs = self._stage_inputs(batch)
        config = get_model_config(self.chunks[0])
        coeff = float(self.options.moe_aux_loss_coeff)
        if coeff:
            config.moe_aux_loss_coeff = coeff * self._aux_loss_scale(inputs)
        try:
            run_schedule(self.chunks, inputs, loss, forward_only=False)
        finally:
            if coeff:
                config.moe_aux_loss_coeff = coeff
        # Megatron sums the gradient buffers over the data-parallel group (``finish_grad_sync``),
        # the tensor-parallel partial gradients of replicated norms (QK layernorm) and, under
        # PP > 1, the gradients of the tied embedding's two copies (first and last stage).
        finalize_model_grads(self.chunks)
        acc.reduce()  # only the last stage's tensor-parallel rank 0 of each data-parallel rank adds
        metrics = acc.result()
        metrics.update(self._optimizer_step())
        return metrics

    def _grads_finite(self) -> bool:
        """Whether every rank's reduced gradient buffers are finite (all ranks get the same answer)."""
        import torch.distributed as dist

        finite = all(bool(torch.isfinite(buffer.grad_data).all()) for buffer in self._grad_buffers())
        flag = torch.tensor([1.0 if finite else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() > 0)

    def _optimizer_step(self) -> dict[str, float]:
        """Megatron's ``step()``: gradient norm over model-parallel shards, clipping, Adam update.

        Not-finite gradients skip the update (the fp32 Megatron optimizer would apply it); the
        schedule advances either way so resumed and uninterrupted runs stay aligned.
        """
        assert self.optimizer is not None
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self._grads_finite():
            updated, grad_norm, _ = self.optimizer.step()
        else:
            self.optimizer.prepare_grads()
            updated, grad_norm = False, self.optimizer.get_grad_norm()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1
        return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped_step": 0.0 if updated else 1.0}

    # ------------------------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under Hugging Face names, on every rank.

        The bridge gathers them over tensor parallelism and, under PP > 1, broadcasts each from
        the pipeline stage that holds it. Without autograd: the broadcasts write parameters'
        storage, which must not enter the next training step's graph.
        """
        yield from _without_grad(self.bridge.export_hf_weights(self.modules, cpu=True, show_progress=False))

    def save_checkpoint(self, path: str) -> None:
        """Each rank saves its model shard, Megatron optimizer state, schedule, step and RNG to ``path``.

        Under the distributed optimizer the sharded Adam state goes to a separate file per
        model-parallel rank (``save_parameter_state``, gathered on data-parallel rank 0).
        """
        import torch.distributed as dist

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = {"format": CHECKPOINT_FORMAT, "role": self.role, "step": self.global_step,
                 "model": self.modules[0].state_dict(),
                 "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                 "rng": torch.get_rng_state()}
        target = out / STATE_FILE.format(rank=self.rank)
        tmp = target.with_name(target.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, target)
        if self.optimizer is not None and self.options.use_distributed_optimizer:
            self.optimizer.save_parameter_state(str(out / PARAM_STATE_FILE.format(rank=_model_parallel_rank())))
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same parallel layout and optimizer kind)."""
        src = Path(path) / STATE_FILE.format(rank=self.rank)
        if not src.is_file():
            raise FileNotFoundError(f"MegatronTrainWorker.load_checkpoint: no {src.name} in checkpoint directory "
                                    f"'{Path(path).resolve()}'")
        state = torch.load(src, map_location="cpu", weights_only=False)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"MegatronTrainWorker.load_checkpoint: '{src}' has format {state.get('format')!r}, "
                             f"expected {CHECKPOINT_FORMAT} (Megatron optimizer state)")
        self.modules[0].load_state_dict(state["model"])
        if self.optimizer is not None:
            if state["optimizer"] is None:
                raise ValueError(f"MegatronTrainWorker.load_checkpoint: '{src}' holds no optimizer state "
                                 f"(saved by a {state.get('role')!r} worker)")
            self.optimizer.load_state_dict(state["optimizer"])
            if self.options.use_distributed_optimizer:
                params = Path(path) / PARAM_STATE_FILE.format(rank=_model_parallel_rank())
                self.optimizer.load_parameter_state(str(params))
            self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["step"])
        torch.set_rng_state(state["rng"])

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face directory (config, safetensors, tokenizer) through Megatron-Bridge."""
        import torch.distributed as dist

        with torch.no_grad():  # see named_weights
            self.bridge.save_hf_pretrained(self.modules, path, show_progress=False)
        if self.rank == 0:
            from transformers import AutoTokenizer

            source = self.job.model.tokenizer or self.model_path
            try:
                AutoTokenizer.from_pretrained(source).save_pretrained(path)
            except (OSError, ValueError):
                pass  # a model directory without tokenizer files: weights and config only
        if dist.is_initialized():
            dist.barrier()

    # ------------------------------------------------------------------------------------------

    @property
    def offloaded(self) -> bool:
        """Whether :meth:`offload` moved the model off the accelerator (never on the CPU)."""
        return self._offloaded

    def offload(self) -> None:
        """Free the accelerator: parameters and optimizer state to host memory, gradient buffers
        released (they are scratch between steps). A no-op on the CPU.

        Parameters keep their CUDA device and identity: their storage is emptied and refilled
        (as Megatron's buffers do), because moving a parameter's ``.data`` to another device
        resets its gradient accumulator and would drop the backward hooks Megatron DDP put there.
        """
        if self.device.type == "cpu" or self._offloaded:
            return
        torch.cuda.synchronize(self.device)
        for buffer in self._grad_buffers():
            buffer.offload_to_cpu(move_params=self._params_in_buffers(), move_grads=True)
        self._param_backup = {}
        if not self._params_in_buffers():
            for param in self._unique_params():
                self._param_backup[param] = param.detach().to("cpu")
                param.data.untyped_storage().resize_(0)
        self._move_optimizer_state(torch.device("cpu"))
        self._offloaded = True
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring back everything :meth:`offload` moved (gradient buffers come back zeroed)."""
        if not self._offloaded:
            return
        for param, saved in self._param_backup.items():
            param.data.untyped_storage().resize_(saved.numel() * saved.element_size())
            param.data.copy_(saved)
        self._param_backup = {}
        for buffer in self._grad_buffers():
            buffer.reload_from_cpu(move_params=self._params_in_buffers(), move_grads=True)
        self._move_optimizer_state(self.device)
        torch.cuda.synchronize(self.device)
        self._offloaded = False

    def _params_in_buffers(self) -> bool:
        """Whether the parameters live in Megatron DDP's parameter buffers (distributed optimizer)."""
        return self.optimizer is not None and self.options.use_distributed_optimizer

    def _grad_buffers(self) -> list[Any]:
        from megatron.core.distributed import DistributedDataParallel

        return [buffer for chunk in self.chunks if isinstance(chunk, DistributedDataParallel)
                for buffer in chunk.buffers + chunk.expert_parallel_buffers]

    def _unique_params(self) -> list[torch.nn.Parameter]:
        return list({id(p): p for chunk in self.modules for p in chunk.parameters()}.values())

    def _move_optimizer_state(self, device: torch.device) -> None:
        if self.optimizer is None:
            return
        for _, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)

    def close(self) -> None:
        """Leave model parallelism and the process group."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _hf_config(config_file: Path) -> dict[str, Any]:
    """A Hugging Face ``config.json`` as a dict (ValueError naming the file if it is not a JSON table)."""
    import json

    try:
        value = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"[model] path: '{config_file}' is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"[model] path: '{config_file}' does not hold a JSON table")
    return value


# The Hugging Face config keys Megatron-Bridge reads as the number of routed experts (``num_moe_experts``).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _hf_num_experts(config: dict[str, Any]) -> int | None:
    """The number of routed experts of a Hugging Face config, None for a dense model."""
    for key in _EXPERT_COUNT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _without_grad(items: Iterator[Any]) -> Iterator[Any]:
    """``items`` advanced under ``torch.no_grad()``, the caller's grad mode untouched between items."""
    while True:
        with torch.no_grad():
            try:
                item = next(items)
            except StopIteration:
                return
        yield item


def _tensor_parallel_rank() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_tensor_model_parallel_rank())


def _broadcast_from_last_stage(tensor: torch.Tensor) -> None:
    """Overwrite ``tensor`` on every pipeline stage with the last stage's (in place)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())


def _model_parallel_rank() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_model_parallel_group().rank())


def _tmp_rendezvous() -> str:
    import tempfile

    fd, name = tempfile.mkstemp(prefix="loongsage-megatron-")
    os.close(fd)
    os.unlink(name)
    return name


def create_train_worker(ctx: Any) -> MegatronTrainWorker:
    """Factory of the ``megatron`` train backend (``ctx`` is a ``TrainWorkerContext``)."""
    return MegatronTrainWorker(ctx)
