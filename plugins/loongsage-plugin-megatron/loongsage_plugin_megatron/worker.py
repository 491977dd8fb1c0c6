"""``MegatronTrainWorker``: one rank of the Megatron-Core train backend.

The policy is a Megatron-Core ``GPTModel`` built by Megatron-Bridge from the Hugging Face
directory ``[model] path`` (:mod:`.model`; weights converted on load, converted back by
:meth:`~MegatronTrainWorker.named_weights` and :meth:`~MegatronTrainWorker.save_hf`). Losses
come from the host's :class:`~loongsage_core.algorithms.LossPipeline`, already divided by the
mini-batch's global norm, so gradients add up across micro-batches and data-parallel ranks.

The worker composes the backend's parts, each a module of its own:

* :mod:`.parallel`: ``[train] backend_args``, the ``(tp, pp, dp, ep)`` layout (with virtual
  pipeline stages, expert tensor parallelism and the refused context parallelism), the process
  group and Megatron-Core's parallel state;
* :mod:`.model`: the model built by Megatron-Bridge (MoE settings and activation recomputation
  included), in ``[model] dtype`` (float32, bfloat16 or float16; ``[model] fp32_lm_head`` for a
  float32 output projection);
* :mod:`.forward_backward`: micro-batches through Megatron-Core's forward-backward schedule;
* :mod:`.optimizer`: Megatron DDP (float32 gradient buffers), Megatron-Core's Adam (float32
  master weights of 16-bit parameters, float16's dynamic loss scaling), the learning-rate
  schedule, the step;
* :mod:`.checkpoint`: per-rank checkpoints (resumed runs continue exactly), Hugging Face export;
* :mod:`.lora`: ``[train] lora`` through Megatron-Bridge's PEFT (adapters in PEFT's layout);
* :mod:`.offload`: the model and optimizer state to host memory and back;
* :mod:`.router_replay`: ``[algorithm] router_replay`` on a Mixture-of-Experts model (the
  engine's recorded experts replayed in every forward, through Megatron-Core's ``RouterReplay``).

Training is Megatron-Core's own. The micro-batches run through
``megatron.core.pipeline_parallel.get_forward_backward_func()``: no pipelining under PP = 1, the
1F1B schedule under PP > 1 (interleaved over the ``vpp`` model chunks of each rank with
``backend_args.vpp``: the worker's ``modules`` and ``chunks`` hold one entry per chunk, and
checkpoints, export, LoRA and offload cover all of them), where the last stage computes the loss
on each micro-batch's logits.
The loss function returns Megatron's ``(loss, num_tokens, info)`` triple, so Megatron
back-propagates the host's loss as it is (no division by the number of micro-batches or tokens).
``finalize_model_grads`` sums the gradients over the data-parallel group, the tensor-parallel
partial gradients of replicated norms and, under PP > 1, the gradients of the tied embedding's
copies on the first and last stage.

Vocabulary-level KL and distillation terms of the host's loss (``LossPipeline.needs_logits``: a
``kl`` or ``distill_kl`` component whose ``requires`` is ``"topk"`` or ``"logits"``, such as the
distill plugin's ``opd_topk_kl``, ``opd_full_kl`` and ``opd_jsd``) get the last stage's
next-token logits over the Hugging Face vocabulary, ``[B, T - 1, V]`` float32 as the torch
backend passes them: under TP > 1 the vocabulary shards are gathered by Megatron-Core's
autograd-aware gather, so each rank's shard of the output layer gets its share of the gradient.

Every rank returns the same results: :meth:`~MegatronTrainWorker.forward` and
:meth:`~MegatronTrainWorker.score` broadcast the last stage's outputs over the pipeline group,
training metrics are reported by the last stage's tensor-parallel rank 0 of each data-parallel
rank and all-reduced, and :meth:`~MegatronTrainWorker.named_weights` gathers full weights from
every stage. The ranks of
one model-parallel group (its ``tp * pp`` ranks) must be given the same rows; a clear error
says so otherwise.

Under expert parallelism (``ep`` > 1) an expert-parallel group is made of ``ep`` data-parallel
ranks, which hold different rows, so its MoE layers exchange tokens between them (the bridge's
``alltoall`` dispatcher on CUDA, ``allgather`` on the CPU). Those ranks must all call
:meth:`~MegatronTrainWorker.forward` / :meth:`~MegatronTrainWorker.train_mini_batch` together;
they agree on one micro-batch shape and count (a rank short of rows runs all-padding
micro-batches, which add no loss). Expert gradients are summed over the expert-data-parallel
group (``dp / ep`` ranks) by Megatron DDP's expert buffers, dense ones over the data-parallel
group, so a step equals EP = 1's on the same global batch (the load-balancing loss: :mod:`.model`).

Router Replay (``[algorithm] router_replay``, Mixture-of-Experts models only; a dense model is a
clear error at construction) routes every forward's tokens to the experts the engine recorded
(see :meth:`~MegatronTrainWorker.forward` and :mod:`.router_replay`).

The ``reference`` role is forward-only (no DDP wrapper, no optimizer): the frozen reference
model beside the policy (none in a LoRA run: the policy's adapters are disabled instead), and
the model of the ``megatron`` distillation teacher (:mod:`.teacher`), which reads
:meth:`MegatronTrainWorker.score` (log-probs, top-k and full logits as ``TeacherOutputs`` lays them out).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Mapping

import attrs
import torch

from loongsage_core.backend_api.loss import LossPipeline, MetricAccumulator
from loongsage_hookspecs import AggregationNorm, Batch

from . import bridge_compat, checkpoint, cpu_compat, layout, parallel
from . import lora as lora_lib
from .job_checks import job_layout
from .model import aux_loss_scale, build_model, model_dtype
from .offload import HostOffload
from .optimizer import build_optimizer, optimizer_step, reset_adam_state, step_hyperparameters, wrap_ddp

_OPEN: "weakref.WeakSet[MegatronTrainWorker]" = weakref.WeakSet()
"""The workers of this process not closed yet: they share its process group and parallel state."""


class MegatronTrainWorker:
    """One rank of the megatron train backend (implements ``loongsage_hookspecs.TrainWorker``)."""

    #: the policy's tokenizer, loaded when a batch holds constrained turns (:meth:`_grammar_tokenizer`)
    _tokenizer: Any = None
    #: gradients of :meth:`accumulate_gradients` wait in the DDP buffers for :meth:`optimizer_step`
    _accumulating: bool = False

    def __init__(self, ctx: Any) -> None:
        job = ctx.job
        if ctx.role not in ("actor", "reference"):
            raise ValueError(f"megatron train backend: role {ctx.role!r} is not supported (actor, reference)")
        if not job.model.path:
            raise ValueError("megatron train backend: [model] path must name a Hugging Face directory "
                             "(Megatron-Bridge converts it)")
        self.dtype = model_dtype(job.model.dtype)
        if job.train.micro_batch_size < 1:
            raise ValueError(f"[train] micro_batch_size must be >= 1, got {job.train.micro_batch_size}")
        self.job, self.role = job, ctx.role
        self.rank, self.world_size = int(ctx.rank), int(ctx.world_size)
        if ctx.role == "reference":
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                # built beside the policy in its actor: the same ranks, sharded the same way
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model_path = job.resolve_path(job.model.path) if hasattr(job, "resolve_path") else job.model.path
        found = job_layout(job, self.model_path, self.world_size, self.role, cuda=not cpu_compat.cuda_missing())
        self.options, hf_config, self.num_experts = found.options, found.hf_config, found.num_experts
        self.tp, self.pp, self.dp, self.ep = found.tp, found.pp, found.dp, found.ep
        self.micro_batch_size = job.train.micro_batch_size
        self.sequence_parallel = layout.sequence_parallel(self.options, self.tp, self.num_experts)
        # [algorithm] router_replay: every forward of a mixture-of-experts model replays the
        # engine's routing (.router_replay); the actor's scoring pass also compares without it
        replay = bool(job.algorithm.router_replay)
        self.router_replay_compare = (replay and self.role == "actor"
                                      and bool(job.algorithm.router_replay_compare))

        auto_bridge = cpu_compat.import_bridge()
        bridge_compat.apply()
        cpu_compat.apply()
        parallel.init_parallel(self.options, ctx, self.rank, self.world_size, self.tp, self.pp, self.ep)
        try:  # a worker that fails to start leaves no process group or parallel state behind
            cpu_compat.init_rng_tracker(int(job.run.seed))
            self.device = torch.device("cpu") if cpu_compat.cuda_missing() else torch.device(
                "cuda", torch.cuda.current_device())
            built = build_model(auto_bridge, self.model_path, self.options, (self.tp, self.pp, self.ep), hf_config,
                                self.num_experts, self.device, router_replay=replay, dtype=self.dtype,
                                fp32_lm_head=bool(getattr(job.model, "fp32_lm_head", False)),
                                sequence_parallel=self.sequence_parallel)
            self.bridge, self.vocab_size = built.bridge, built.vocab_size
            # Unwrapped model chunks (what Megatron-Bridge converts to and from Hugging Face names).
            self.modules = built.modules
            self.router_replay: Any = None
            if replay:
                from megatron.core.utils import get_model_config

                from .router_replay import MegatronRouterReplay

                shard = (parallel.tensor_parallel_rank(), self.tp) if self.sequence_parallel else None
                self.router_replay = MegatronRouterReplay(self.modules, get_model_config(self.modules[0]),
                                                          sequence_shard=shard)
            # [train] lora: the policy trains adapters only; its reference is itself, adapters off
            self.lora = lora_lib.apply_lora(self.modules, job.train.lora, self.num_experts) if (
                self.role == "actor" and job.train.lora is not None) else None

            self.global_step = 0
            self.optimizer: Any = None
            self.scheduler: Any = None
            self.pipeline: LossPipeline | None = None
            if self.role == "actor":
                self.pipeline = LossPipeline.from_job(job, ctx.components)
                self.chunks: list[Any] = wrap_ddp(self.modules, self.options)
                self.model = self.chunks[0]
                self.optimizer, self.scheduler = build_optimizer(self.chunks, job.train, self.options, self.dtype)
                self.model.train()
            else:
                self.chunks = list(self.modules)
                self.model = self.chunks[0]
                self.model.requires_grad_(False)
                self.model.eval()
        except BaseException:
            parallel.close_parallel()
            raise
        self._host = HostOffload(self.device, self.modules, self.chunks, self.optimizer, params_in_buffers=(
            self.optimizer is not None and self.options.use_distributed_optimizer))
        _OPEN.add(self)

    # -- rows and micro-batches ------------------------------------------------------------------

    def _stage_inputs(self, batch: Batch) -> list[Any]:
        """The micro-batches of ``batch`` as model inputs.

        Under PP > 1 they share one fixed shape. Under EP > 1 every MoE layer exchanges tokens
        with the other ranks of its expert-parallel group, which hold other rows (they are
        data-parallel replicas): those ranks agree on one shape and one number of micro-batches
        (the largest of the group), a rank with fewer rows running all-padding micro-batches.
        """
        inputs = self._stage_inputs_of(batch)
        if any(batch.meta.get("constraints") or ()):  # turns decoded under a grammar: replayed (forward_backward)
            tokenizer = self._grammar_tokenizer()
            inputs = [attrs.evolve(item, grammar_tokenizer=tokenizer) for item in inputs]
        return inputs

    def _grammar_tokenizer(self) -> Any:
        """The policy's tokenizer, loaded the first time a batch holds constrained turns."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.job.model.tokenizer or self.model_path)
        return self._tokenizer

    def _stage_inputs_of(self, batch: Batch) -> list[Any]:
        """:meth:`_stage_inputs` before the grammar tokenizer is attached."""
        from .forward_backward import real_lengths, stage_inputs

        multiple = self.tp if self.sequence_parallel else 1  # Megatron-Core splits the sequence evenly
        if self.ep == 1:
            return stage_inputs(batch, self.micro_batch_size, self.device, fixed_shape=self.pp > 1,
                                width_multiple=multiple)
        rows = len(batch)
        width = int(real_lengths(batch).max()) if rows else 0
        count = -(-rows // self.micro_batch_size)
        agreed = torch.tensor([width, count], dtype=torch.int64, device=self.device)
        parallel.all_reduce_max_over_experts(agreed)
        return stage_inputs(batch, self.micro_batch_size, self.device, fixed_shape=True,
                            width=int(agreed[0]), micro_batches=int(agreed[1]), width_multiple=multiple)

    def _check_same_rows(self, batch: Batch, caller: str) -> None:
        """ValueError unless every rank of this rank's model-parallel group got the same rows."""
        parallel.check_same_rows(batch, caller, self.tp, self.pp, self.dp, self.device)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's model replica: the controller gives every rank of one replica the same rows."""
        return parallel.data_parallel_rank()

    @property
    def data_parallel_size(self) -> int:
        return int(self.dp)

    # -- forward and training --------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` ``[B, T]`` (float32, CPU, no gradient).

        Under PP > 1 the last pipeline stage computes them and broadcasts them to the other
        stages, so every rank returns them. Under EP > 1 every rank of an expert-parallel group
        must call it (with its own rows, possibly none): their MoE layers run together.

        Router Replay (``[algorithm] router_replay``, a batch with ``routed_experts``): the
        forward routes each token to its recorded experts (:mod:`.router_replay`). The actor with
        ``[algorithm] router_replay_compare`` also returns ``router_agreement`` (per token, the
        share of its MoE layers whose experts equal the record; -1 without a record) and, from a
        second pass routing on its own, ``logprobs_no_replay`` and ``router_agreement_no_replay``.
        """
        return self._scores(batch, compare=self.router_replay_compare and "routed_experts" in batch,
                            caller="forward")

    def _scores(self, batch: Batch, *, compare: bool, caller: str) -> dict[str, torch.Tensor]:
        if "input_ids" not in batch:
            raise KeyError(f"MegatronTrainWorker.{caller}: the batch has no 'input_ids' tensor")
        if self.offloaded:
            raise RuntimeError(f"MegatronTrainWorker.{caller}: the worker is offloaded; call onload() first")
        self._check_same_rows(batch, caller)
        rows, width = batch["input_ids"].shape
        keys = ("logprobs", "entropy") + (
            ("router_agreement", "logprobs_no_replay", "router_agreement_no_replay") if compare else ())
        inputs = self._stage_inputs(batch)
        if not inputs:
            return {key: torch.zeros(0, width) for key in keys}
        with self._routing(replay=True, measure=compare):
            out = self._token_scores(inputs, rows, width)
            if compare:
                out["router_agreement"] = self._router_agreement(width)
        if compare:
            with self._routing(replay=False, measure=True):
                out["logprobs_no_replay"] = self._token_scores(inputs, rows, width)["logprobs"]
                out["router_agreement_no_replay"] = self._router_agreement(width)
        return out

    def _token_scores(self, inputs: list[Any], rows: int, width: int) -> dict[str, torch.Tensor]:
        """``logprobs`` and ``entropy`` ``[rows, width]`` (CPU) of one forward-only pass; under
        PP > 1 broadcast from the last stage."""
        from .forward_backward import token_outputs

        outs = self._run_forward_only(
            inputs, lambda inputs, logits: token_outputs(logits, inputs, tp=self.tp, entropy_grad=False))
        if outs:
            both = torch.stack([torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])]).float()
        else:  # not the last pipeline stage: receive below
            both = torch.empty(2, rows, width, dtype=torch.float32, device=self.device)
        if self.pp > 1:
            parallel.broadcast_from_last_stage(both)
        return {"logprobs": both[0].cpu(), "entropy": both[1].cpu()}

    def _routing(self, *, replay: bool, measure: bool) -> Any:
        """The Router Replay mode of the forwards inside (a no-op without Router Replay)."""
        if self.router_replay is None:
            return contextlib.nullcontext()
        return self.router_replay.routing(replay=replay, measure=measure)

    def _router_agreement(self, width: int) -> torch.Tensor:
        """The last measured pass's per-token router agreement ``[rows, width]`` (CPU), each
        stage's MoE layers (and under sequence parallelism each rank's tokens) counted together."""
        def sum_stages(counts: torch.Tensor) -> None:
            if self.pp > 1:
                parallel.sum_over_pipeline(counts)
            if self.sequence_parallel:  # each tensor-parallel rank counted its share of the sequence
                parallel.sum_over_tensor_parallel(counts)

        return self.router_replay.agreement(width, self.device, sum_stages).float().cpu()

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
        ``output_device`` as soon as computed (full logits never pile up on the accelerator).
        Under TP > 1 the vocabulary shards are gathered; under PP > 1 the last stage's outputs
        are broadcast over the pipeline group (:meth:`_score_parts_from_last_stage`), so every
        rank returns the same result. :mod:`.teacher` calls it."""
        from .forward_backward import teacher_outputs

        if "input_ids" not in batch:
            raise KeyError("MegatronTrainWorker.score: the batch has no 'input_ids' tensor")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
            raise ValueError(f"MegatronTrainWorker.score: topk must be an integer >= 0, got {topk!r}")
        if topk > self.vocab_size:
            raise ValueError(f"MegatronTrainWorker.score: topk={topk} exceeds the vocabulary size {self.vocab_size}")
        if self.offloaded:
            raise RuntimeError("MegatronTrainWorker.score: the worker is offloaded; call onload() first")
        self._check_same_rows(batch, "score")
        device = torch.device(output_device)
        width = int(batch["input_ids"].shape[1])
        inputs = self._stage_inputs(batch)
        parts = self._run_forward_only(inputs, lambda item, logits: teacher_outputs(
            logits, item, tp=self.tp, vocab=self.vocab_size, topk=topk, return_logits=return_logits,
            logits_dtype=logits_dtype, device=device))
        shapes = self._score_shapes(topk, return_logits, logits_dtype)
        if self.pp > 1:
            parts = self._score_parts_from_last_stage(parts, inputs, shapes, width, device)
        return {key: torch.cat([part[key] for part in parts]) if parts
                else torch.zeros((0, width, *trailing), dtype=dtype, device=device)
                for key, (trailing, dtype) in shapes.items()}

    def _score_shapes(self, topk: int, return_logits: bool,
                      logits_dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The keys :meth:`score` returns, each with its trailing shape (after ``[B, T]``) and dtype."""
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"logprobs": ((), torch.float32)}
        if topk:
            shapes.update(topk_ids=((topk,), torch.long), topk_logprobs=((topk,), torch.float32))
        if return_logits:
            shapes["logits"] = ((self.vocab_size,), logits_dtype)
        return shapes

    def _score_parts_from_last_stage(self, parts: list[dict[str, torch.Tensor]], inputs: list[Any],
                                     shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], width: int,
                                     device: torch.device) -> list[dict[str, torch.Tensor]]:
        """The last pipeline stage's per-micro-batch :meth:`score` outputs ``parts`` on every stage.

        Only the last stage computes logits, so only it has ``parts``; the other stages know their
        shapes (a micro-batch's real rows, the batch's ``width``, the trailing sizes and dtypes of
        ``shapes``) and receive them by a broadcast over the pipeline group. One micro-batch and
        key at a time passes through this rank's device (the collective's: CUDA under NCCL), then
        moves to ``device``, so full logits never pile up on the accelerator.
        """
        from megatron.core import parallel_state

        last = parallel_state.is_pipeline_last_stage()
        if last and len(parts) != len(inputs):
            raise RuntimeError(f"MegatronTrainWorker.score: the last pipeline stage collected {len(parts)} "
                               f"outputs for {len(inputs)} micro-batches")
        shared = []
        for index, item in enumerate(inputs):
            received = {}
            for key, (trailing, dtype) in shapes.items():
                if last:
                    buffer = parts[index][key].to(self.device).contiguous()
                else:
                    buffer = torch.empty((item.rows, width, *trailing), dtype=dtype, device=self.device)
                parallel.broadcast_from_last_stage(buffer)
                received[key] = parts[index][key] if last else buffer.to(device)
            shared.append(received)
        return shared

    @property
    def serves_reference(self) -> bool:
        """Whether this worker scores the KL reference itself (a LoRA policy: :meth:`reference_forward`)."""
        return self.lora is not None

    @torch.no_grad()
    def reference_forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """:meth:`forward` of the base model, the LoRA adapters disabled (the KL reference of a
        LoRA run; the same weights, no second copy)."""
        if self.lora is None:
            raise RuntimeError("MegatronTrainWorker.reference_forward: the policy has no LoRA adapter to disable; "
                               "the reference is a worker of its own (role 'reference')")
        with self.lora.disable_adapter(self.modules):
            return self._scores(batch, compare=False, caller="reference_forward")

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
            return run_schedule(self.chunks, inputs, on_logits, forward_only=True, routing=self.router_replay)
        finally:
            for chunk in self.chunks:
                chunk.train(was_training)

    def _require_trainable(self, what: str) -> LossPipeline:
        if self.optimizer is None or self.pipeline is None:
            raise RuntimeError(f"MegatronTrainWorker.{what}: the {self.role!r} worker is forward-only")
        if self.offloaded:
            raise RuntimeError(f"MegatronTrainWorker.{what}: the worker is offloaded; call onload() first")
        return self.pipeline

    def train_mini_batch(self, batch: Batch, norm: AggregationNorm) -> dict[str, float]:
        """One optimizer step on this rank's rows of a mini-batch with global denominators ``norm``
        (:meth:`accumulate_gradients`, :meth:`optimizer_step`): the mini-batch's ``train/*`` metrics."""
        metrics = self.accumulate_gradients(batch, norm)
        metrics.update(self.optimizer_step())
        return metrics

    def accumulate_gradients(self, batch: Batch, norm: AggregationNorm, *,
                             pipeline: LossPipeline | None = None) -> dict[str, float]:
        """Forward and backward over this rank's rows of ``batch``, the gradients added to the DDP
        gradient buffers (no step); returns the ``train/*`` loss metrics of the whole mini-batch.

        The micro-batches go through Megatron-Core's forward-backward schedule (1F1B under
        PP > 1); the last pipeline stage computes the loss (``pipeline``, a ``LossPipeline``;
        ``None``: the job's) on each micro-batch's logits. A vocabulary-level KL or distillation
        term (``LossPipeline.needs_logits``) also gets the next-token logits over the Hugging Face
        vocabulary (:meth:`_loss_outputs`). Calls add up until :meth:`optimizer_step` (``StepwiseTraining``).
        Under EP > 1 every rank of an expert-parallel group must call it (see :meth:`forward`).
        """
        from megatron.core.utils import get_model_config

        from .forward_backward import run_schedule

        own = self._require_trainable("accumulate_gradients")
        pipeline = own if pipeline is None else pipeline
        self._check_same_rows(batch, "accumulate_gradients")
        if not self._accumulating:  # the first part of a step starts from zero gradients
            self._zero_gradients()
            self._accumulating = True
        for chunk in self.chunks:
            chunk.train()
        acc = MetricAccumulator()
        entropy_grad = pipeline.entropy_coef != 0.0
        keep_logits = pipeline.needs_logits  # a vocabulary-level KL or distillation term
        # Every rank of a tensor-parallel group computes the same loss: one of them reports it.
        reports = parallel.tensor_parallel_rank() == 0

        def loss(inputs: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            if not inputs.rows:  # an all-padding micro-batch (expert parallelism): no loss, same graph
                return logits.sum() * 0.0, torch.zeros((), dtype=torch.int), {}
            logprobs, entropy, vocab_logits = self._loss_outputs(logits, inputs, entropy_grad=entropy_grad,
                                                                 keep_logits=keep_logits)
            value, micro_metrics = pipeline.loss(inputs.micro, logprobs, entropy, norm, logits=vocab_logits)
            if reports:
                acc.add(micro_metrics, inputs.micro["loss_mask"])
            return value, inputs.micro["loss_mask"].sum().to(torch.int), {}

        inputs = self._stage_inputs(batch)
        config = get_model_config(self.chunks[0])
        coeff = float(self.options.moe_aux_loss_coeff)
        if coeff:
            config.moe_aux_loss_coeff = coeff * aux_loss_scale(inputs, self.dp, self.device)
        try:
            with self._routing(replay=True, measure=False):  # every training forward replays the records
                run_schedule(self.chunks, inputs, loss, forward_only=False, routing=self.router_replay)
        finally:
            if coeff:
                config.moe_aux_loss_coeff = coeff
        acc.reduce()  # only the last stage's tensor-parallel rank 0 of each data-parallel rank adds
        return acc.result()

    def optimizer_step(self, *, hyperparameters: Mapping[str, float] | None = None) -> dict[str, float]:
        """One step of Megatron's optimizer on the gradients accumulated since the last step.

        ``hyperparameters`` (``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``,
        ``grad_clip``; a caller driving steps in parts) are set on the optimizer's parameter
        groups before this step and stay, except ``grad_clip``, which replaces
        ``[train] grad_clip`` for this step only (see :func:`.optimizer.step_hyperparameters`).
        """
        from megatron.core.distributed import finalize_model_grads

        self._require_trainable("optimizer_step")
        if not self._accumulating:  # nothing accumulated since the last step: a step on zero gradients
            self._zero_gradients()
        # Megatron sums the gradient buffers over the data-parallel group (``finish_grad_sync``),
        # the tensor-parallel partial gradients of replicated norms (QK layernorm) and, under
        # PP > 1, the gradients of the tied embedding's two copies (first and last stage).
        finalize_model_grads(self.chunks)
        with step_hyperparameters(self.optimizer, hyperparameters):
            metrics = optimizer_step(self.optimizer, self.scheduler, self.chunks, self.device)
        self._accumulating = False
        self.global_step += 1
        return metrics

    def _zero_gradients(self) -> None:  # the DDP buffers and the optimizer's own (master) gradients
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def reset_optimizer_state(self) -> None:
        """Forget Adam's moments and step counts (weights loaded without their optimizer state)."""
        self._require_trainable("reset_optimizer_state")
        reset_adam_state(self.optimizer)

    def _loss_outputs(self, logits: torch.Tensor, inputs: Any, *, entropy_grad: bool, keep_logits: bool,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the host's loss reads of one micro-batch's last-stage ``logits``: per-token
        log-probs and entropies ``[rows, T]`` and, with ``keep_logits`` (a vocabulary-level KL or
        distillation term), the next-token logits ``[rows, T - 1, V]`` over the Hugging Face
        vocabulary, float32, laid out as the torch backend passes them (gathered from the
        vocabulary shards under TP > 1, the gradient flowing back to each shard); else None."""
        from .forward_backward import token_outputs, token_outputs_and_logits

        if not keep_logits:
            logprobs, entropy = token_outputs(logits, inputs, tp=self.tp, entropy_grad=entropy_grad)
            return logprobs, entropy, None
        return token_outputs_and_logits(logits, inputs, tp=self.tp, vocab=self.vocab_size, entropy_grad=entropy_grad)

    # -- weights and checkpoints -----------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under Hugging Face names, on every rank (see :func:`.checkpoint.export_hf_weights`);
        in a LoRA run the adapter alone, under PEFT's names (:func:`.lora.adapter_weights`)."""
        if self.lora is not None:
            yield from lora_lib.adapter_weights(self.bridge, self.modules)
            return
        yield from checkpoint.export_hf_weights(self.bridge, self.modules)

    def save_checkpoint(self, path: str) -> None:
        """Each rank saves its model shard (every model chunk), Megatron optimizer state, schedule,
        step and RNG to ``path``.

        Under the distributed optimizer the sharded Adam state goes to a separate file per
        model-parallel rank (``save_parameter_state``, gathered on data-parallel rank 0).
        """
        checkpoint.save_checkpoint(path, rank=self.rank, role=self.role, step=self.global_step,
                                   modules=self.modules, optimizer=self.optimizer, scheduler=self.scheduler,
                                   distributed_optimizer=self.options.use_distributed_optimizer,
                                   adapter_only=self.lora is not None)

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same parallel layout and optimizer kind)."""
        self.global_step = checkpoint.load_checkpoint(
            path, rank=self.rank, modules=self.modules, optimizer=self.optimizer, scheduler=self.scheduler,
            distributed_optimizer=self.options.use_distributed_optimizer, adapter_only=self.lora is not None)

    def save_adapter(self, path: str) -> None:
        """Write the PEFT adapter directory on rank 0 (every rank takes part: :func:`.lora.save_adapter`)."""
        if self.lora is None:
            raise RuntimeError("MegatronTrainWorker.save_adapter: the policy has no LoRA adapter ([train] lora)")
        weights = dict(lora_lib.adapter_weights(self.bridge, self.modules))  # gathered on every rank
        if self.rank == 0:
            lora_lib.save_adapter(path, weights, self.job.train.lora, base_model=str(self.model_path))
        parallel.barrier()

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face directory (config, safetensors, tokenizer) through Megatron-Bridge;
        in a LoRA run the adapters are merged into the weights (``W + alpha / rank * B @ A``)."""
        checkpoint.save_hf(self.bridge, self.modules, path, rank=self.rank,
                           tokenizer_source=self.job.model.tokenizer or self.model_path)

    # -- residency -------------------------------------------------------------------------------

    @property
    def offloaded(self) -> bool:
        """Whether :meth:`offload` moved the model off the accelerator (never on the CPU)."""
        return self._host.offloaded

    def offload(self) -> None:
        """Free the accelerator: parameters and optimizer state to host memory, gradient buffers
        released (see :mod:`.offload`). A no-op on the CPU."""
        self._host.offload()

    def onload(self) -> None:
        """Bring back everything :meth:`offload` moved (gradient buffers come back zeroed)."""
        self._host.onload()

    def close(self) -> None:
        """Leave model parallelism and the process group, once no other worker of this process
        (a reference beside its policy, another model of a Tinker service) still uses them."""
        _OPEN.discard(self)
        if not _OPEN:
            parallel.close_parallel()
