"""Every CPU workaround the megatron backend needs, in one place.

Megatron-Core and Megatron-Bridge are written for CUDA machines with Transformer Engine. The
backend uses them unchanged on GPUs; on a machine without CUDA, :func:`apply` swaps in the few
CPU-safe replacements below (the mixed-precision optimizer and its loss scalers among them;
each names the upstream call it stands in for; some, the MoE
router's matmul and the torch norm under sequence parallelism, are needed wherever Transformer
Engine is missing), and :func:`import_bridge`
imports Megatron-Bridge although Transformer Engine and Triton are absent.
:func:`configure_provider` sets the model config switches a CPU needs (the layer spec, the
pipeline's point-to-point sync, the MoE token dispatcher and expert layout), preferred to
replacements wherever Megatron offers one.

:func:`distributed_optimizer_blocker` says why Megatron-Core's distributed optimizer cannot run
here (it is not patched: its parameter sharding only accepts CUDA tensors).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Iterator

REQUIREMENTS_HINT = ("the megatron backend needs megatron-core and megatron-bridge: "
                     "pip install -r requirements-megatron.txt")

# Import-only placeholders: Megatron-Bridge imports these at module level (LoRA layers, fused
# kernels) although the GPT path this backend uses never calls them.
_STUBBED_TOP_LEVEL = ("transformer_engine", "transformer_engine_torch", "triton")

# Megatron-Core modules imported before the placeholders exist, so their own
# "is Transformer Engine installed?" checks keep answering no.
_PREIMPORT = (
    "megatron.core",
    "megatron.core.extensions.transformer_engine",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.transformer.heterogeneous.linear_replacements",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.tensor_parallel",
    "megatron.core.parallel_state",
)


def cuda_missing() -> bool:
    """Whether the CPU replacements are needed (no usable CUDA device)."""
    import torch

    return not torch.cuda.is_available()


class _PlaceholderMeta(type):
    """Classes whose every attribute is another placeholder class (``te.ops.Sequential``)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _placeholder(name: str) -> type:
    return _PlaceholderMeta(name, (), {"__init__": lambda self, *a, **k: None,
                                       "__call__": lambda self, *a, **k: self})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(name)
        setattr(self, name, value)
        return value


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in _STUBBED_TOP_LEVEL:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _PlaceholderModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # type: ignore[attr-defined]


@contextlib.contextmanager
def _placeholders() -> Iterator[None]:
    present = {n for n in _STUBBED_TOP_LEVEL if _installed(n)}
    if len(present) == len(_STUBBED_TOP_LEVEL):
        yield
        return
    finder = _PlaceholderFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if isinstance(sys.modules[m], _PlaceholderModule)]:
            del sys.modules[name]


def _installed(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def import_bridge() -> Any:
    """``megatron.bridge.AutoBridge``; raises ImportError naming requirements-megatron.txt if absent.

    Replaces a plain ``from megatron.bridge import AutoBridge``: when Transformer Engine or Triton
    is missing, placeholders stand in for them only while Megatron-Bridge is being imported.
    """
    import importlib

    try:
        for name in _PREIMPORT:
            importlib.import_module(name)
        with _placeholders():
            from megatron.bridge import AutoBridge
    except ImportError as exc:
        raise ImportError(f"{REQUIREMENTS_HINT} ({exc})") from exc
    return AutoBridge


def apply() -> None:
    """Install the replacements (idempotent): the router's matmul without Transformer Engine,
    the CPU replacements without CUDA; a no-op with both."""
    if not _installed("transformer_engine"):
        _router_gating_without_te()
        _peft_without_te()
        _torch_norm_with_sequence_parallel()
    if not cuda_missing():
        return
    import torch

    # Replaces torch.cuda.current_device(): Megatron-Core layers place new parameters and
    # buffers, and DistributedDataParallel its gradient buffers (``_ParamAndGradBuffer``), on
    # ``torch.cuda.current_device()``; without CUDA they go to the CPU.
    if not getattr(torch.cuda.current_device, "_loongsage_cpu", False):
        def current_device() -> torch.device:
            return torch.device("cpu")

        current_device._loongsage_cpu = True  # type: ignore[attr-defined]
        torch.cuda.current_device = current_device  # type: ignore[assignment]
    _contiguous_tp_scatter()
    _optimizer_scratch_on_cpu()
    _mixed_precision_optimizer_on_cpu()
    _clip_without_cuda_type_check()
    _schedule_scratch_on_cpu()
    _tied_embedding_setup_on_cpu()
    _recompute_rng_on_cpu()


@functools.cache
def _cuda_factories_on_cpu() -> type:
    """A torch function mode class: tensors a call creates with a CUDA ``device=`` go to the CPU,
    and ``Tensor.cuda()`` leaves a (CPU) tensor where it is."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaFactoriesOnCpu(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is torch.Tensor.cuda:
                return args[0]
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs = {**kwargs, "device": "cpu"}
            return func(*args, **kwargs)

    return CudaFactoriesOnCpu


def _scratch_on_cpu(fn: Any) -> Any:
    """``fn`` with the small tensors it creates on ``device="cuda"`` created on the CPU instead."""
    if getattr(fn, "_loongsage_cpu", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_factories_on_cpu()():
            return fn(*args, **kwargs)

    wrapper._loongsage_cpu = True  # type: ignore[attr-defined]
    return wrapper


def _optimizer_scratch_on_cpu() -> None:
    """Run Megatron-Core's fp32 optimizer bookkeeping on the CPU.

    Replaces ``FP32Optimizer.__init__`` (its unit loss scale is ``torch.tensor([1.0],
    device="cuda")``) and ``get_grad_norm_fp32`` as ``megatron.core.optimizer.optimizer`` calls it
    from ``MegatronOptimizer.get_grad_norm`` / ``clip_grad_norm`` and ``ChainedOptimizer.get_grad_norm``
    (its overflow buffer and its fallback ``local_multi_tensor_l2_norm`` result are created with
    ``device="cuda"``). Both run unchanged, with those few tensors created on the CPU.
    """
    from megatron.core.optimizer import optimizer as megatron_optimizer

    megatron_optimizer.FP32Optimizer.__init__ = _scratch_on_cpu(  # type: ignore[method-assign]
        megatron_optimizer.FP32Optimizer.__init__)
    megatron_optimizer.get_grad_norm_fp32 = _scratch_on_cpu(megatron_optimizer.get_grad_norm_fp32)


@functools.cache
def _cuda_type_names() -> type:
    """A torch function mode class: what :func:`_cuda_factories_on_cpu` does, and ``Tensor.type()``
    (no arguments) of a CPU tensor answers the CUDA name (``torch.cuda.BFloat16Tensor`` for a
    ``torch.BFloat16Tensor``), as upstream's dtype tests expect."""
    import torch

    class CudaTypeNames(_cuda_factories_on_cpu()):  # type: ignore[misc]
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
            return super().__torch_function__(func, types, args, kwargs)

    return CudaTypeNames


def _mixed_precision_optimizer_on_cpu() -> None:
    """Build Megatron-Core's mixed-precision optimizer and its loss scalers on the CPU.

    Replaces ``Float16OptimizerWithFloat16Params.__init__`` (``megatron.core.optimizer.optimizer``,
    what ``get_megatron_optimizer`` builds under ``bf16`` / ``fp16``): it sorts the parameters by
    ``param.type()``, keeping a float32 master copy of each ``torch.cuda.{Half,BFloat16}Tensor``
    and raising ``TypeError`` for anything that is not a ``torch.cuda.*Tensor``, and
    ``MixedPrecisionOptimizer.__init__`` creates its ``found_inf`` flag, overflow buffer and unit
    scale with ``device="cuda"``. It runs unchanged, with ``Tensor.type()`` answering the CUDA
    name of a CPU tensor's type and those tensors created on the CPU.

    Replaces ``ConstantGradScaler.__init__`` / ``DynamicGradScaler.__init__`` (their scale, bounds
    and factors are ``device="cuda"`` tensors) and ``DynamicGradScaler.load_state_dict`` (it moves
    the saved scale with ``.cuda()``), which run unchanged with those tensors on the CPU.
    """
    from megatron.core.optimizer import grad_scaler
    from megatron.core.optimizer import optimizer as megatron_optimizer

    cls = megatron_optimizer.Float16OptimizerWithFloat16Params
    if not getattr(cls.__init__, "_loongsage_cpu", False):
        upstream = cls.__init__

        @functools.wraps(upstream)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            with _cuda_type_names()():
                upstream(self, *args, **kwargs)

        __init__._loongsage_cpu = True  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[method-assign]
    for scaler in (grad_scaler.ConstantGradScaler, grad_scaler.DynamicGradScaler):
        scaler.__init__ = _scratch_on_cpu(scaler.__init__)  # type: ignore[method-assign]
    grad_scaler.DynamicGradScaler.load_state_dict = _scratch_on_cpu(  # type: ignore[method-assign]
        grad_scaler.DynamicGradScaler.load_state_dict)


def _clip_without_cuda_type_check() -> None:
    """Replace ``clip_grad_by_total_norm_fp32`` as ``megatron.core.optimizer.optimizer`` calls it.

    Upstream asserts every gradient is a ``torch.cuda.FloatTensor`` before scaling the gradients
    by ``max_norm / (total_norm + 1e-6)`` when that is below 1. The replacement applies the same
    coefficient through ``torch.nn.utils.clip_grads_with_norm_``, which uses that very formula.
    """
    from megatron.core.optimizer import optimizer as megatron_optimizer

    if getattr(megatron_optimizer.clip_grad_by_total_norm_fp32, "_loongsage_cpu", False):
        return

    def clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                     use_decoupled_grad: bool = False) -> None:
        import torch

        if use_decoupled_grad:
            raise NotImplementedError("decoupled gradients (precision-aware optimizer) need CUDA")
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        params = [p for p in params if p.grad is not None]
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(float(total_norm)))

    clip_grad_by_total_norm_fp32._loongsage_cpu = True  # type: ignore[attr-defined]
    megatron_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _schedule_scratch_on_cpu() -> None:
    """Run Megatron-Core's forward-backward schedules with their token counter on the CPU.

    Replaces ``forward_backward_no_pipelining``, ``forward_backward_pipelining_without_interleaving``
    and ``forward_backward_pipelining_with_interleaving`` in
    ``megatron.core.pipeline_parallel.schedules`` (what ``get_forward_backward_func`` returns):
    they create ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")``. They run
    unchanged, with that counter created on the CPU; the pipeline's send and receive buffers are
    allocated on ``torch.cuda.current_device()``, which :func:`apply` already points at the CPU.
    """
    from megatron.core.pipeline_parallel import schedules

    for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving"):
        setattr(schedules, name, _scratch_on_cpu(getattr(schedules, name)))


def _recompute_rng_on_cpu() -> None:
    """Let Megatron-Core's activation recomputation save and restore the RNG state without CUDA.

    Replaces ``_get_all_rng_states`` and ``_set_all_rng_states`` of
    ``megatron.core.tensor_parallel.random``, which ``CheckpointFunction`` (the recomputation of
    ``recompute_granularity``) and ``_fork_rng`` call to replay a recomputed forward with the
    random state of the original one: upstream reads and writes the CUDA generator
    (``torch.cuda.get_rng_state``), which a CPU build of torch does not have. The replacements
    keep the CPU generator and the model-parallel tracker's states as upstream does, and no CUDA
    state.
    """
    import torch
    from megatron.core.tensor_parallel import random as mp_random

    if getattr(mp_random._get_all_rng_states, "_loongsage_cpu", False):
        return

    def get_all_rng_states() -> tuple[Any, None, Any]:
        return torch.get_rng_state(), None, mp_random.get_cuda_rng_tracker().get_states()

    def set_all_rng_states(cpu_rng_state: Any, cuda_rng_state: Any, cuda_rng_state_tracker: Any) -> None:
        torch.set_rng_state(cpu_rng_state)
        mp_random.get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)

    get_all_rng_states._loongsage_cpu = True  # type: ignore[attr-defined]
    mp_random._get_all_rng_states = get_all_rng_states
    mp_random._set_all_rng_states = set_all_rng_states


def _tied_embedding_setup_on_cpu() -> None:
    """Replace ``LanguageModule.setup_embeddings_and_output_layer`` (Megatron-Core) under PP > 1.

    With tied input and output embeddings on different pipeline stages, upstream moves the
    output layer's copy to the GPU (``weight.data = weight.data.cuda()``) before all-reducing it
    over the embedding group. It runs unchanged, with ``.cuda()`` leaving the CPU tensor in place.
    """
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _scratch_on_cpu(  # type: ignore[method-assign]
        LanguageModule.setup_embeddings_and_output_layer)


def _peft_without_te() -> None:
    """Let Megatron-Bridge's LoRA (``megatron.bridge.peft``) wrap Megatron-Core's own linear layers
    without Transformer Engine.

    ``megatron.bridge.peft.utils`` sets ``HAVE_TE`` when importing the Transformer Engine layer
    classes of Megatron-Core's extension module succeeds, which it does without Transformer Engine
    too (the names exist as stand-ins that are not classes), so every ``isinstance`` test against
    them raises ``TypeError``. Without Transformer Engine there are no such layers to test for.
    """
    import importlib

    importlib.import_module("megatron.bridge.peft.utils").HAVE_TE = False


def _router_gating_without_te() -> None:
    """Let ``RouterGatingLinearFunction`` (``megatron.core.transformer.moe.moe_utils``) run
    without Transformer Engine.

    Its ``forward`` and ``backward`` test ``te_general_gemm is not None`` to choose Transformer
    Engine's GEMM over ``torch.mm``, but the module only defines that name when its Transformer
    Engine import succeeds, so the test raises ``NameError``. Defining it as None selects the
    ``torch.mm`` path upstream already has.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _torch_norm_with_sequence_parallel() -> None:
    """Let Megatron-Core's ``WrappedTorchNorm`` (the norm of the local layer spec, without
    Transformer Engine or Apex) run under sequence parallelism.

    Upstream asserts ``not config.sequence_parallel``: a norm computes each token alone, so it is
    exact on a shard of the sequence; what sequence parallelism needs is that its weights, which
    every tensor-parallel rank holds whole but trains on its own tokens only, carry
    ``sequence_parallel = True`` so that ``finalize_model_grads`` sums their gradients over the
    tensor-parallel group (as Transformer Engine's and Apex's norms mark them). The replacement
    builds the torch norm from a copy of the config without the switch and marks the weights.
    """
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(WrappedTorchNorm.__new__, "_loongsage_sp", False):
        return
    upstream = WrappedTorchNorm.__new__

    def new(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return upstream(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = upstream(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new._loongsage_sp = True  # type: ignore[attr-defined]
    WrappedTorchNorm.__new__ = staticmethod(new)  # type: ignore[assignment]


def distributed_optimizer_blocker(cuda: bool) -> str | None:
    """Why Megatron-Core's ``DistributedOptimizer`` cannot run on ranks with (``cuda``) or without
    CUDA devices, or None if it can.

    Without CUDA it cannot: ``DistributedOptimizer._build_model_and_main_param_groups`` sorts the
    parameters it shards by ``param.type()`` and raises ``TypeError`` for anything but
    ``torch.cuda.{Float,Half,BFloat16}Tensor``; no small replacement makes it shard CPU tensors.
    """
    if cuda:
        return None
    return ("Megatron-Core's DistributedOptimizer needs CUDA: it only shards torch.cuda.*Tensor "
            "parameters (DistributedOptimizer._build_model_and_main_param_groups raises TypeError "
            "for CPU tensors) and no CUDA device is available")


def _contiguous_tp_scatter() -> None:
    """Wrap Megatron-Bridge's ``MegatronParamMapping.scatter_to_tp_ranks`` so the splits it sends
    are contiguous.

    Row-parallel weights are split with ``torch.chunk(w, tp, dim=1)``, which gives strided views.
    Upstream sends ``s.to(device=..., dtype=...)``: on CUDA that copies each split into fresh,
    contiguous memory, but on the CPU it returns the strided view itself, and gloo's ``scatter``
    then sends the wrong elements (every row-parallel shard loads garbage under TP > 1).
    """
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    original = MegatronParamMapping.scatter_to_tp_ranks
    if getattr(original, "_loongsage_contiguous", False):
        return

    def scatter_to_tp_ranks(self: Any, splits: Any, *args: Any, **kwargs: Any) -> Any:
        if splits:
            splits = [s.contiguous() for s in splits]
        return original(self, splits, *args, **kwargs)

    scatter_to_tp_ranks._loongsage_contiguous = True  # type: ignore[attr-defined]
    MegatronParamMapping.scatter_to_tp_ranks = scatter_to_tp_ranks  # type: ignore[method-assign]


def init_rng_tracker(seed: int) -> None:
    """Seed the model-parallel RNG.

    On CUDA this is ``tensor_parallel.model_parallel_cuda_manual_seed(seed)``. On the CPU it
    replaces that call: the tracker that call builds stores CUDA generator states, so a tracker
    whose ``fork`` keeps the (CPU) default generator is installed instead; the backend runs with
    dropout 0, so no forked stream is ever drawn from.
    """
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mp_random

    torch.manual_seed(seed)
    if not cuda_missing():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def configure_provider(provider: Any) -> None:
    """Adjust a Megatron-Bridge model provider for a machine without Transformer Engine or CUDA.

    Without Transformer Engine, replaces the provider's default ``transformer_engine_layer_spec``
    (fused layers) with Megatron-Bridge's ``local_layer_spec`` (Megatron-Core's own torch layers).

    Without CUDA, sets the config switch ``batch_p2p_sync = False``: the pipeline's batched
    point-to-point exchange (``torch.distributed.batch_isend_irecv``, which Gloo runs) is
    otherwise followed by ``torch.cuda.synchronize()`` in ``P2PCommunicator._communicate``.

    Mixture-of-Experts models (``num_moe_experts`` set): without CUDA, the token dispatcher
    ``moe_token_dispatcher_type = "allgather"`` (``MoEAllGatherTokenDispatcher``, plain
    all-gather / reduce-scatter collectives) instead of the bridge's ``"alltoall"``, whose
    ``MoEAlltoAllTokenDispatcher.__init__`` creates a ``torch.cuda.Stream()``. Without Transformer
    Engine, ``moe_grouped_gemm = False`` (one MLP per expert, Megatron-Core's ``SequentialMLP``:
    the grouped experts need Transformer Engine or the CUDA ``grouped_gemm`` kernels) and
    ``moe_permute_fusion = moe_router_fusion = False`` (Transformer Engine's fused kernels).
    """
    moe = bool(getattr(provider, "num_moe_experts", None))
    if cuda_missing():
        provider.batch_p2p_sync = False
        if moe:
            provider.moe_token_dispatcher_type = "allgather"
    if _installed("transformer_engine"):
        return
    from megatron.bridge.models.gpt_provider import local_layer_spec

    provider.transformer_layer_spec = local_layer_spec
    if moe:
        provider.moe_grouped_gemm = False
        provider.moe_permute_fusion = False
        provider.moe_router_fusion = False
