"""``MegatronTrainWorker``: one rank of the Megatron-Core train backend.

The policy is a Megatron-Core ``GPTModel`` built by Megatron-Bridge from the Hugging Face
directory ``[model] path`` (weights converted on load, converted back by :meth:`named_weights`
and :meth:`save_hf`). Losses come from the host's
:class:`~loongsage_core.algorithms.LossPipeline`, already divided by the mini-batch's global
norm, so gradients add up across micro-batches and data-parallel ranks.

``[train] backend_args`` of this backend:

* ``tp``: tensor-parallel size (default 1); ``pp``: pipeline-parallel size (only 1 is supported);
* ``dp``: data-parallel size (default ``world_size // (tp * pp)``; ``tp * pp * dp`` must equal
  the number of ranks);
* ``dist_backend``: ``"auto"`` (NCCL on CUDA, Gloo on CPU), ``"gloo"`` or ``"nccl"``.

The optimizer is ``torch.optim.AdamW`` over the Megatron parameters (each rank steps its own
shards); the gradient norm for clipping counts tensor-parallel shards once across the group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import attrs
import torch

from loongsage_core.algorithms import LossPipeline, MetricAccumulator
from loongsage_core.config import structure_args
from loongsage_hookspecs import AggregationNorm, Batch

from . import cpu_compat
from .logits import logprobs_and_entropy

STATE_FILE = "megatron_state_rank{rank}.pt"
CHECKPOINT_FORMAT = 1


@attrs.define(frozen=True)
class BackendOptions:
    """The validated ``[train] backend_args`` of the megatron backend (see the module docstring)."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    dist_backend: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "gloo", "nccl")))

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "BackendOptions":
        return structure_args(cls, args, "[train] backend_args", "megatron backend")


def parallel_sizes(options: BackendOptions, world_size: int) -> tuple[int, int, int]:
    """``(tp, pp, dp)`` for ``world_size`` ranks; raises ValueError naming the bad backend_args."""
    tp, pp = int(options.tp), int(options.pp)
    if tp < 1 or pp < 1:
        raise ValueError(f"[train] backend_args: tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if pp != 1:
        raise ValueError(f"[train] backend_args.pp = {pp}: pipeline parallelism is not supported by the "
                         "megatron backend yet (use pp = 1)")
    if world_size % (tp * pp):
        raise ValueError(f"[train] backend_args: {world_size} ranks are not divisible by tp * pp = {tp * pp}")
    dp = world_size // (tp * pp) if options.dp is None else int(options.dp)
    if tp * pp * dp != world_size:
        raise ValueError(f"[train] backend_args: tp * pp * dp = {tp}*{pp}*{dp} != {world_size} ranks")
    return tp, pp, dp


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
        self.options = BackendOptions.from_args(dict(job.train.backend_args))
        self.tp, self.pp, self.dp = parallel_sizes(self.options, self.world_size)
        self.micro_batch_size = job.train.micro_batch_size
        self.model_path = job.resolve_path(job.model.path) if hasattr(job, "resolve_path") else job.model.path
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"[model] path: no config.json in model directory '{self.model_path}'")

        auto_bridge = cpu_compat.import_bridge()
        cpu_compat.apply()
        self._init_parallel(ctx)
        cpu_compat.init_rng_tracker(int(job.run.seed))
        self.device = torch.device("cpu") if cpu_compat.cuda_missing() else torch.device(
            "cuda", torch.cuda.current_device())

        self.bridge = auto_bridge.from_hf_pretrained(self.model_path, dtype=torch.float32)
        provider = self.bridge.to_megatron_provider(load_weights=True)
        provider.tensor_model_parallel_size = self.tp
        provider.pipeline_model_parallel_size = self.pp
        provider.params_dtype = torch.float32
        provider.bf16 = provider.fp16 = False
        provider.hidden_dropout = provider.attention_dropout = 0.0
        provider.sequence_parallel = False
        cpu_compat.configure_provider(provider)
        provider.finalize()
        self.modules = provider.provide_distributed_model(
            wrap_with_ddp=False, use_cpu_initialization=self.device.type == "cpu", mixed_precision_wrapper=None)
        self.model = self.modules[0]

        self.global_step = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.pipeline: LossPipeline | None = None
        if self.role != "actor":
            self.model.requires_grad_(False)
            self.model.eval()
            return
        from .schedule import make_scheduler

        train = job.train
        self.pipeline = LossPipeline(job, ctx.components)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=train.lr,
                                           betas=tuple(train.betas), eps=train.eps,
                                           weight_decay=train.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, train)
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
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp,
                                                 pipeline_model_parallel_size=self.pp)

    def _token_outputs(self, micro: Batch, *, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies ``[b, T]`` of one micro-batch (0 at padding and position 0)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        ids = micro["input_ids"].to(self.device)
        attention = micro.get("attention_mask")
        attention = torch.ones_like(ids) if attention is None else attention.to(self.device)
        lengths = attention.sum(1)
        positions = torch.arange(ids.shape[1], device=ids.device)
        if not torch.equal(attention.bool(), positions[None, :] < lengths[:, None]):
            raise ValueError("megatron train backend: attention_mask must be right-padded (ones then zeros)")
        width = max(int(lengths.max()) if ids.shape[0] else 1, 1)
        ids_w = ids[:, :width]
        pos = positions[:width].unsqueeze(0).expand_as(ids_w)
        # Megatron's mask marks the positions to hide (True above the diagonal); right padding
        # never influences the real tokens before it, so the causal mask is the whole mask.
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=ids.device), diagonal=1)
        logits = self.model(input_ids=ids_w, position_ids=pos, attention_mask=causal[None, None])
        if self.tp > 1:  # vocab-sharded output layer: gather the full vocabulary (differentiable)
            logits = gather_from_tensor_model_parallel_region(logits)
        logprobs, entropy = logprobs_and_entropy(logits[:, :-1].float(), ids_w, entropy_grad=entropy_grad)
        real = attention[:, :width] > 0
        logprobs = torch.where(real, logprobs, torch.zeros_like(logprobs))
        entropy = torch.where(real, entropy, torch.zeros_like(entropy))
        pad = (0, ids.shape[1] - width)
        return torch.nn.functional.pad(logprobs, pad), torch.nn.functional.pad(entropy, pad)

    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` ``[B, T]`` (float32, CPU, no gradient)."""
        if "input_ids" not in batch:
            raise KeyError("MegatronTrainWorker.forward: the batch has no 'input_ids' tensor")
        was_training = self.model.training
        self.model.eval()
        try:
            outs = [self._token_outputs(m, entropy_grad=False) for m in batch.chunks(self.micro_batch_size)]
        finally:
            self.model.train(was_training)
        if not outs:
            empty = torch.zeros(0, batch["input_ids"].shape[1])
            return {"logprobs": empty, "entropy": empty.clone()}
        return {"logprobs": torch.cat([o[0] for o in outs]).cpu(), "entropy": torch.cat([o[1] for o in outs]).cpu()}

    def train_mini_batch(self, batch: Batch, norm: AggregationNorm) -> dict[str, float]:
        """One optimizer step on this rank's rows of a mini-batch with global denominators ``norm``."""
        if self.optimizer is None or self.pipeline is None:
            raise RuntimeError(f"MegatronTrainWorker.train_mini_batch: the {self.role!r} worker is forward-only")
        if self.pipeline.needs_logits:
            raise ValueError("megatron train backend: vocabulary-level KL estimators (full logits) are not "
                             "supported yet")
        self.model.train()
        acc = MetricAccumulator()
        entropy_grad = self.pipeline.entropy_coef != 0.0
        for micro in batch.chunks(self.micro_batch_size):
            logprobs, entropy = self._token_outputs(micro, entropy_grad=entropy_grad)
            micro = Batch(tensors={k: v.to(self.device) for k, v in micro.tensors.items()}, meta=micro.meta)
            loss, metrics = self.pipeline.loss(micro, logprobs, entropy, norm)
            loss.backward()
            acc.add(metrics, micro["loss_mask"])
        self._sum_data_parallel_gradients()
        acc.reduce()
        metrics = acc.result()
        metrics.update(self._optimizer_step())
        return metrics

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _sum_data_parallel_gradients(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.dp == 1:
            return
        group = parallel_state.get_data_parallel_group()
        for p in self._params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)

    def _grad_norm(self) -> torch.Tensor:
        """Global L2 norm: tensor-parallel shards summed over the TP group, replicas counted once."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._params():
            sq = p.grad.detach().double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.tp > 1:
            dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        return (sharded + replicated).sqrt()

    def _optimizer_step(self) -> dict[str, float]:
        assert self.optimizer is not None
        params = self._params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grad_norm = self._grad_norm()
        clip = self.job.train.grad_clip
        finite = bool(torch.isfinite(grad_norm))
        if finite and clip > 0 and float(grad_norm) > clip:
            scale = clip / (float(grad_norm) + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1
        return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped_step": 0.0 if finite else 1.0}

    # ------------------------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under Hugging Face names (gathered over tensor parallelism by the bridge)."""
        yield from self.bridge.export_hf_weights(self.modules, cpu=True, show_progress=False)

    def save_checkpoint(self, path: str) -> None:
        """Each rank saves its model shard, optimizer, schedule and step to ``path``."""
        import torch.distributed as dist

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = {"format": CHECKPOINT_FORMAT, "step": self.global_step, "model": self.model.state_dict(),
                 "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                 "rng": torch.get_rng_state()}
        target = out / STATE_FILE.format(rank=self.rank)
        tmp = target.with_name(target.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, target)
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same parallel layout)."""
        src = Path(path) / STATE_FILE.format(rank=self.rank)
        if not src.is_file():
            raise FileNotFoundError(f"MegatronTrainWorker.load_checkpoint: no {src.name} in checkpoint directory "
                                    f"'{Path(path).resolve()}'")
        state = torch.load(src, map_location="cpu", weights_only=False)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"MegatronTrainWorker.load_checkpoint: '{src}' has format {state.get('format')!r}")
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["step"])
        torch.set_rng_state(state["rng"])

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face directory (config, safetensors, tokenizer) through Megatron-Bridge."""
        import torch.distributed as dist

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

    def close(self) -> None:
        """Leave model parallelism and the process group."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _tmp_rendezvous() -> str:
    import tempfile

    fd, name = tempfile.mkstemp(prefix="loongsage-megatron-")
    os.close(fd)
    os.unlink(name)
    return name


def create_train_worker(ctx: Any) -> MegatronTrainWorker:
    """Factory of the ``megatron`` train backend (``ctx`` is a ``TrainWorkerContext``)."""
    return MegatronTrainWorker(ctx)
