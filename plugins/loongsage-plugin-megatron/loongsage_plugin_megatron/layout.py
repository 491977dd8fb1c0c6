"""The megatron train backend's options and parallel layout, checked before any rank starts.

``[train] backend_args`` (:class:`BackendOptions`):

* ``tp``: tensor-parallel size (default 1); ``pp``: pipeline-parallel size (default 1; the
  model's layers must split evenly over the stages);
* ``vpp``: virtual pipeline stages per pipeline rank (Megatron-Core's
  ``virtual_pipeline_model_parallel_size``, the interleaved 1F1B schedule; default none). Each
  rank holds ``vpp`` model chunks of ``layers / (pp * vpp)`` layers; needs ``pp > 1`` and the
  layers to split evenly over the ``pp * vpp`` chunks (``vpp = 1`` is one chunk per rank, the
  plain 1F1B schedule). The schedule needs at least ``pp``
  micro-batches: a call with fewer runs extra all-padding ones (:mod:`.forward_backward`);
* ``cp``: context-parallel size (default 1). Counted in the layout (``tp * pp * cp * dp`` ranks)
  and handed to Megatron-Core's parallel state, but ``cp > 1`` is refused
  (:func:`context_parallel_blocker`): Megatron-Core runs it only in Transformer Engine's
  attention, and this backend does not split its inputs and per-token loss tensors along the
  sequence yet;
* ``dp``: data-parallel size (default ``world_size // (tp * pp * cp)``; ``tp * pp * cp * dp``
  must equal the number of ranks);
* ``dist_backend``: ``"auto"`` (NCCL on CUDA, Gloo on CPU), ``"gloo"`` or ``"nccl"``;
* ``use_distributed_optimizer``: shard the optimizer state over the data-parallel group with
  Megatron-Core's ``DistributedOptimizer`` (default false; needs CUDA, a clear error otherwise);
* ``ep``: expert-parallel size (default 1; MoE models only; must divide the number of experts
  and ``(tp / etp) * dp``, the ranks Megatron-Core forms expert-parallel groups from);
* ``etp``: expert tensor-parallel size (Megatron-Core's ``expert_tensor_parallel_size``; default
  ``tp``; MoE models only): the experts' weights split over ``etp`` ranks while the dense layers
  split over ``tp``. It must divide ``tp`` (the expert tensor-parallel group stays inside one
  tensor-parallel group, whose ranks hold the same rows) and the experts' hidden size, and below
  ``tp`` it needs ``ep > 1`` (:func:`check_expert_tensor_parallel`), e.g. ``tp = 2, etp = 1,
  ep = 2``: each rank holds half of the experts whole;
* ``sequence_parallel``: Megatron-Core's sequence parallelism (the activations outside the
  tensor-parallel matmuls split along the sequence over the tensor-parallel ranks); needs
  ``tp > 1``. Default (:func:`sequence_parallel`): on for a MoE model under ``tp > 1`` (Megatron-Core's
  MoE layers train under tensor parallelism only with it, so a MoE model with ``tp > 1`` and
  ``sequence_parallel = false`` is refused), off otherwise (a dense model keeps whole sequences
  per rank unless asked);
* ``recompute_granularity``: activation recomputation in training (Megatron-Core's setting of
  the same name; default none): ``"full"`` recomputes whole transformer layers in the backward
  pass, ``"selective"`` only the core attention. ``"full"`` needs ``recompute_method``
  (``"uniform"``: the layers of each stage in groups of ``recompute_num_layers``, each group
  recomputed from its input; ``"block"``: the first ``recompute_num_layers`` layers of each model
  chunk) and ``recompute_num_layers`` (1 to the layers of one pipeline stage); ``"selective"``
  takes neither (:func:`check_recompute`). Under Router Replay a recomputed router replays the
  experts of its forward (:mod:`.router_replay`);
* ``moe_aux_loss_coeff``: weight of the MoE load-balancing loss (default 0: off).

:func:`parallel_sizes` and :func:`check_layout` turn them and the model's ``config.json`` into
the ``(tp, pp, dp, ep)`` layout or a ValueError naming the key at fault. Nothing here imports
torch or Megatron-Core: ``loongsage validate`` runs these checks (:mod:`.job_checks`) on the
machine that reads the job, and each worker again when it starts; :mod:`.parallel` then joins
the process groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from loongsage_core.backend_api.schema import structure_args

from . import cpu_compat

RECOMPUTE_GRANULARITIES = ("full", "selective")
"""``backend_args.recompute_granularity`` values (Megatron-Core's ``recompute_granularity``)."""
RECOMPUTE_METHODS = ("uniform", "block")
"""``backend_args.recompute_method`` values (Megatron-Core's ``recompute_method``)."""


def _size(_: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    """attrs validator: a parallel size or layer count, an integer >= 1 (None allowed: the default)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"'{attribute.name}' must be an integer >= 1, got {value!r}")


def _one_of(*values: str) -> Any:
    """attrs validator: one of ``values``, or None (the key left out)."""
    def check(_: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
        if value is not None and value not in values:
            raise ValueError(f"'{attribute.name}' must be one of {', '.join(map(repr, values))} or left out, "
                             f"got {value!r}")

    return check


@attrs.define(frozen=True)
class BackendOptions:
    """The validated ``[train] backend_args`` of the megatron backend (see the module docstring)."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    dist_backend: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "gloo", "nccl")))
    use_distributed_optimizer: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    ep: int = 1
    sequence_parallel: bool | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    moe_aux_loss_coeff: float = attrs.field(default=0.0, converter=float, validator=attrs.validators.ge(0.0))
    vpp: int | None = attrs.field(default=None, validator=_size)
    cp: int = attrs.field(default=1, validator=_size)
    etp: int | None = attrs.field(default=None, validator=_size)
    recompute_granularity: str | None = attrs.field(default=None, validator=_one_of(*RECOMPUTE_GRANULARITIES))
    recompute_method: str | None = attrs.field(default=None, validator=_one_of(*RECOMPUTE_METHODS))
    recompute_num_layers: int | None = attrs.field(default=None, validator=_size)

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "BackendOptions":
        return structure_args(cls, args, "[train] backend_args", "megatron backend")

    @property
    def virtual_stages(self) -> int | None:
        """Megatron-Core's ``virtual_pipeline_model_parallel_size``: ``vpp``, None for one chunk per rank."""
        return self.vpp if self.vpp is not None and self.vpp > 1 else None

    def expert_tp(self, tp: int) -> int:
        """The expert tensor-parallel size: ``etp``, by default Megatron-Core's (``tp``)."""
        return tp if self.etp is None else int(self.etp)


def parallel_sizes(options: BackendOptions, world_size: int,
                   num_experts: int | None = None) -> tuple[int, int, int, int]:
    """``(tp, pp, dp, ep)`` for ``world_size`` ranks; raises ValueError naming the bad backend_args.

    The ranks are ``tp * pp * cp * dp`` (``cp``: ``backend_args.cp``). ``num_experts`` is the
    model's number of routed experts (None for a dense model). Megatron-Core forms each
    expert-parallel group from the ``(tp / etp) * dp`` ranks of one pipeline stage that share an
    expert tensor-parallel rank, so ``ep`` must divide that (``dp`` under the default ``etp = tp``);
    it must also divide the number of experts (each rank holds an equal share of every MoE
    layer's experts).
    """
    tp, pp, cp, ep = int(options.tp), int(options.pp), int(options.cp), int(options.ep)
    if tp < 1 or pp < 1:
        raise ValueError(f"[train] backend_args: tp and pp must be >= 1, got tp={tp}, pp={pp}")
    names, model = ("tp * pp * cp", tp * pp * cp) if cp > 1 else ("tp * pp", tp * pp)
    if world_size % model:
        raise ValueError(f"[train] backend_args: {world_size} ranks are not divisible by {names} = {model}")
    dp = world_size // model if options.dp is None else int(options.dp)
    if model * dp != world_size:
        sizes = "*".join(str(n) for n in ((tp, pp, cp) if cp > 1 else (tp, pp)))
        raise ValueError(f"[train] backend_args: {names} * dp = {sizes}*{dp} != {world_size} ranks")
    if ep < 1:
        raise ValueError(f"[train] backend_args.ep must be >= 1, got {ep}")
    if ep > 1 and not num_experts:
        raise ValueError(f"[train] backend_args.ep = {ep}: expert parallelism needs a Mixture-of-Experts model, "
                         "but the model in [model] path is dense (its config.json names no experts); set ep = 1")
    _check_expert_groups(options, tp, cp, dp, ep)
    if num_experts and num_experts % ep:
        raise ValueError(f"[train] backend_args.ep = {ep} must divide the model's {num_experts} experts "
                         "(every expert-parallel rank holds an equal share)")
    return tp, pp, dp, ep


def _check_expert_groups(options: BackendOptions, tp: int, cp: int, dp: int, ep: int) -> None:
    """ValueError unless Megatron-Core can form the expert layout: ``etp`` divides ``tp`` (see the
    module docstring) and ``ep`` divides the ``(tp / etp) * cp * dp`` ranks of a pipeline stage
    it forms expert-parallel groups from."""
    etp = options.expert_tp(tp)
    if tp % etp:
        raise ValueError(f"[train] backend_args.etp = {etp} must divide tp = {tp} (the megatron backend keeps "
                         "each expert tensor-parallel group inside one tensor-parallel group, whose ranks "
                         "hold the same rows; a larger one would span data-parallel ranks holding others)")
    ranks = tp // etp * cp * dp
    if ranks % ep == 0:
        return
    if etp == tp:
        size = f"cp * dp = {cp}*{dp}" if cp > 1 else f"dp = {dp}"
        raise ValueError(f"[train] backend_args.ep = {ep} must divide the data-parallel size {size} "
                         "(Megatron-Core forms expert-parallel groups from data-parallel ranks)")
    raise ValueError(f"[train] backend_args.ep = {ep} must divide (tp / etp) * dp = ({tp}/{etp})*{cp * dp} = {ranks} "
                     "(Megatron-Core forms expert-parallel groups from the ranks of a pipeline stage that "
                     "share an expert tensor-parallel rank)")


def sequence_parallel(options: BackendOptions, tp: int, num_experts: int | None) -> bool:
    """Whether the model runs Megatron-Core's sequence parallelism: ``backend_args.sequence_parallel``,
    by default on exactly for a Mixture-of-Experts model under ``tp > 1``; ValueError when it is
    asked for with ``tp = 1`` (there is no tensor-parallel group to split the sequence over)."""
    if options.sequence_parallel is None:
        return bool(num_experts) and tp > 1
    if options.sequence_parallel and tp == 1:
        raise ValueError("[train] backend_args.sequence_parallel = true needs tp > 1 (it splits the sequence "
                         "over the tensor-parallel ranks), but tp = 1; set sequence_parallel = false or "
                         "leave it out")
    return bool(options.sequence_parallel)


def check_layout(options: BackendOptions, role: str, tp: int, pp: int, hf_config: dict[str, Any],
                 num_experts: int | None, *, cuda: bool) -> None:
    """Raise ValueError naming the backend_args key that this model cannot run with, or that the
    trainer's devices cannot (``cuda``: whether the ranks have CUDA devices; ``loongsage validate``
    reads it from ``[placement] trainer_gpus``, a worker from its own machine)."""
    sp = sequence_parallel(options, tp, num_experts)
    if role == "actor" and options.use_distributed_optimizer:
        blocker = cpu_compat.distributed_optimizer_blocker(cuda)
        if blocker:
            raise ValueError(f"[train] backend_args.use_distributed_optimizer = true cannot run here: {blocker}; "
                             "set it to false (the optimizer state is then replicated on each rank)")
    blocker = context_parallel_blocker(int(options.cp), cuda)
    if blocker:
        raise ValueError(f"[train] backend_args.cp = {options.cp} cannot run: {blocker}; set cp = 1")
    layers = hf_config.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) and not isinstance(layers, bool) else None
    if layers is not None and layers % pp:
        raise ValueError(f"[train] backend_args.pp = {pp}: the model's {layers} layers do not split evenly "
                         "over the pipeline stages")
    check_virtual_pipeline(options, pp, layers)
    check_recompute(options, pp, layers)
    check_expert_tensor_parallel(options, tp, hf_config, num_experts)
    if num_experts and tp > 1 and not sp:
        # Megatron-Core's MoELayer refuses to train under tensor parallelism without sequence
        # parallelism (MoELayer.forward raises).
        raise ValueError(f"[train] backend_args.tp = {tp} with sequence_parallel = false: Mixture-of-Experts "
                         "models need sequence parallelism under tensor parallelism (Megatron-Core's MoE "
                         "layers train with tp > 1 only with it); set sequence_parallel = true (the default "
                         "for MoE models) or tp = 1")
    if options.moe_aux_loss_coeff and not num_experts:
        raise ValueError(f"[train] backend_args.moe_aux_loss_coeff = {options.moe_aux_loss_coeff}: the model "
                         "in [model] path is dense (no MoE load-balancing loss)")


def check_virtual_pipeline(options: BackendOptions, pp: int, layers: int | None) -> None:
    """ValueError unless ``backend_args.vpp`` fits: Megatron-Core's interleaved schedule needs
    ``pp > 1`` (it interleaves the chunks of several stages; its parallel state refuses a virtual
    size otherwise) and each of the ``pp * vpp`` model chunks gets an equal share of the layers."""
    vpp = options.virtual_stages
    if vpp is None:
        return
    if pp == 1:
        raise ValueError(f"[train] backend_args.vpp = {vpp} needs pp > 1 (virtual pipeline stages interleave "
                         "the model chunks of several pipeline stages), but pp = 1; set pp > 1 or leave vpp out")
    if layers is not None and layers % (pp * vpp):
        raise ValueError(f"[train] backend_args.vpp = {vpp}: the model's {layers} layers do not split evenly "
                         f"over pp * vpp = {pp}*{vpp} = {pp * vpp} model chunks")


def check_recompute(options: BackendOptions, pp: int, layers: int | None) -> None:
    """ValueError unless the recompute keys form a setting Megatron-Core's ``TransformerConfig``
    accepts and uses: ``"full"`` with a ``recompute_method`` and ``recompute_num_layers`` between
    1 and the layers of one pipeline stage; ``"selective"`` without either (Megatron-Core refuses
    ``recompute_num_layers`` there and ignores ``recompute_method``); neither without a
    granularity (nothing would be recomputed)."""
    granularity, method, count = (options.recompute_granularity, options.recompute_method,
                                  options.recompute_num_layers)
    given = [f"{key} = {value!r}" for key, value in (("recompute_method", method), ("recompute_num_layers", count))
             if value is not None]
    if granularity is None:
        if given:
            raise ValueError(f"[train] backend_args.{given[0]} needs recompute_granularity = 'full' (without a "
                             "recompute_granularity nothing is recomputed)")
        return
    if granularity == "selective":
        if given:
            raise ValueError(f"[train] backend_args.{given[0]}: recompute_granularity = 'selective' recomputes "
                             "the core attention of every layer and takes no recompute_method or "
                             "recompute_num_layers (Megatron-Core refuses recompute_num_layers with it); leave "
                             "them out or use recompute_granularity = 'full'")
        return
    if method is None:
        raise ValueError("[train] backend_args.recompute_granularity = 'full' needs recompute_method ('uniform': "
                         "the layers in groups of recompute_num_layers; 'block': the first recompute_num_layers "
                         "layers of each model chunk), as Megatron-Core does")
    per_stage = layers // pp if layers is not None else None
    bound = f" and {per_stage}, the layers of one pipeline stage" if per_stage is not None else ""
    if count is None:
        raise ValueError("[train] backend_args.recompute_granularity = 'full' needs recompute_num_layers "
                         f"(between 1{bound}), as Megatron-Core does")
    if per_stage is not None and count > per_stage:
        raise ValueError(f"[train] backend_args.recompute_num_layers = {count} must be between 1{bound}")


def check_expert_tensor_parallel(options: BackendOptions, tp: int, hf_config: dict[str, Any],
                                 num_experts: int | None) -> None:
    """ValueError unless ``backend_args.etp`` fits the model and the layout: it needs routed
    experts, must divide their hidden size (``moe_intermediate_size``; each expert tensor-parallel
    rank holds an equal slice of every expert) and, below ``tp``, needs ``ep > 1``. That it
    divides ``tp`` is :func:`parallel_sizes`' check.

    Why ``ep > 1``: with ``etp < tp`` the ``tp / etp`` ranks of a tensor-parallel group that hold
    the same experts route different tokens (their shares of the sequence), so the experts'
    gradients must be summed over them, Megatron-Core's expert-data-parallel group. Megatron-Core
    marks expert weights for that group only under expert parallelism
    (``allreduce = not expert_parallel``, ``expert_parallel = expert_model_parallel_size > 1``);
    with ``ep = 1`` they are summed over the data-parallel group alone and the ranks' experts
    silently drift apart.
    """
    etp = options.etp
    if etp is None:
        return
    if not num_experts:
        raise ValueError(f"[train] backend_args.etp = {etp}: expert tensor parallelism needs a Mixture-of-Experts "
                         "model, but the model in [model] path is dense (its config.json names no experts); "
                         "leave etp out")
    if etp < tp and int(options.ep) == 1:
        raise ValueError(f"[train] backend_args.etp = {etp} below tp = {tp} needs ep > 1: the tp / etp ranks "
                         "holding the same experts route different tokens, and Megatron-Core sums expert "
                         "gradients over them (its expert-data-parallel group) only under expert parallelism; "
                         f"with ep = 1 they would train apart. Set ep to a divisor of (tp / etp) * dp, or etp = {tp}")
    hidden = hf_config.get("moe_intermediate_size")
    if isinstance(hidden, int) and hidden % etp:
        raise ValueError(f"[train] backend_args.etp = {etp} must divide the experts' hidden size "
                         f"moe_intermediate_size = {hidden} (each expert tensor-parallel rank holds an equal "
                         "slice of every expert)")


def context_parallel_blocker(cp: int, cuda: bool) -> str | None:
    """Why ``backend_args.cp = cp`` cannot run on ranks with (``cuda``) or without CUDA devices, or
    None if it can (``cp = 1``).

    Megatron-Core 0.16 computes context-parallel attention only in Transformer Engine's
    ``TEDotProductAttention`` (its own ``DotProductAttention``, the attention of the local layer
    spec used without Transformer Engine, asserts ``context_parallel_size == 1``), so it needs
    CUDA. With CUDA it still cannot: each context-parallel rank must get its share of every
    sequence in Megatron's load-balanced layout (``get_batch_on_this_cp_rank``: 2 * cp chunks,
    rank r taking chunks r and 2 * cp - 1 - r) and the per-token log-probs, masks and
    advantages of the host's loss must be split and gathered the same way, which this backend
    does not do yet.
    """
    if cp == 1:
        return None
    missing = ("the megatron backend does not split its micro-batches along the sequence over the "
               "context-parallel ranks (Megatron's load-balanced get_batch_on_this_cp_rank layout) nor the "
               "per-token tensors of the host's loss the same way yet")
    if cuda:
        return missing
    return ("Megatron-Core computes context-parallel attention only in Transformer Engine's "
            "TEDotProductAttention, which needs CUDA (its own DotProductAttention, used without Transformer "
            f"Engine, asserts context_parallel_size == 1), and {missing}")


def read_hf_config(config_file: Path) -> dict[str, Any]:
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


def hf_num_experts(config: dict[str, Any]) -> int | None:
    """The number of routed experts of a Hugging Face config, None for a dense model."""
    for key in _EXPERT_COUNT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None
