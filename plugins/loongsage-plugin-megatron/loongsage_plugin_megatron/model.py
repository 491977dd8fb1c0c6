"""Building the megatron backend's model: a Megatron-Core ``GPTModel`` from a Hugging Face directory.

Megatron-Bridge converts the weights on load (:func:`build_model`) into parameters of
``[model] dtype`` (:data:`MODEL_DTYPES`: float32, or bfloat16 / float16 inside Megatron-Core's
``Float16Module``, whose float32 master weights the optimizer keeps; ``[model] fp32_lm_head``
computes the output projection in float32, :func:`fp32_output_layer`), without dropout, with
sequence parallelism as ``backend_args.sequence_parallel`` resolves it
(:func:`.layout.sequence_parallel`: the embedding scatters the sequence over the
tensor-parallel ranks and the output layer gathers it back, so the logits cover whole sequences;
the inputs' width must be a multiple of ``tp``, which :func:`.forward_backward.stage_inputs`
pads to), with ``calculate_per_token_loss`` (Megatron back-propagates the host's
loss as it is and sums data-parallel gradients). Under PP > 1 each rank holds one pipeline
stage's share of the layers (the first stage the embedding, the last the final norm and output
layer, built with ``pre_process`` / ``post_process``); with ``backend_args.vpp`` virtual stages
it holds ``vpp`` model chunks, chunk ``v`` of stage ``p`` holding the layers of virtual stage
``v * pp + p`` (the embedding in chunk 0 of the first stage, the output layer in the last chunk
of the last). Activation recomputation follows ``backend_args.recompute_*``
(:func:`configure_recompute`).

Mixture-of-Experts models (a Hugging Face config naming routed experts, e.g. ``qwen3_moe``) get
Megatron-Core's MoE layers; under expert parallelism each rank holds ``num_experts / ep`` of
every MoE layer's experts, and under expert tensor parallelism (``etp``) each expert's weights
split over ``etp`` ranks. The load-balancing (auxiliary) loss is off by default
(``moe_aux_loss_coeff = 0``): the gradient is the host's RL loss's exactly; with a positive
coefficient its gradient is added at the scale :func:`aux_loss_scale` gives. Under Router Replay
the routers keep Megatron-Core's unfused top-k, where the recorded experts are swapped in
(:mod:`.router_replay`).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from . import bridge_compat, cpu_compat
from .layout import BackendOptions
from .parallel import sum_over_data_parallel

MODEL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}
"""``[model] dtype`` values the backend trains in (the spec's ``model_dtypes``), and their torch dtypes."""


def model_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``[model] dtype`` = ``name``; ValueError naming the key for another value."""
    if name not in MODEL_DTYPES:
        raise ValueError(f"megatron train backend: [model] dtype = {name!r} is not supported "
                         f"({', '.join(MODEL_DTYPES)})")
    return MODEL_DTYPES[name]


@attrs.define(frozen=True)
class BuiltModel:
    """What :func:`build_model` returns: the bridge (for export), the unwrapped model chunks
    (what Megatron-Bridge converts to and from Hugging Face names) and the Hugging Face
    vocabulary size (Megatron may pad its output layer beyond it)."""

    bridge: Any
    modules: list[Any]
    vocab_size: int


def build_model(auto_bridge: Any, model_path: str, options: BackendOptions, sizes: tuple[int, int, int],
                hf_config: dict[str, Any], num_experts: int | None, device: torch.device, *,
                router_replay: bool = False, dtype: torch.dtype = torch.float32,
                fp32_lm_head: bool = False, sequence_parallel: bool = False) -> BuiltModel:
    """This rank's share of the model in ``model_path``, with ``sizes`` = ``(tp, pp, ep)`` and the
    virtual pipeline, context-parallel and expert tensor-parallel sizes of ``options`` (under
    ``vpp`` one model chunk per virtual stage, Megatron-Bridge's ``vp_stage``, each with its own
    share of the layers), its activation recomputation (:func:`configure_recompute`);
    ``router_replay`` (``[algorithm] router_replay``) keeps the MoE routers on the path that
    replays routing (:mod:`.router_replay`).

    ``dtype`` (``[model] dtype``): the parameters' and the compute's dtype. Under bfloat16 or
    float16 the provider sets Megatron-Core's ``bf16`` / ``fp16`` and ``params_dtype``, and
    Megatron-Bridge wraps each chunk in Megatron-Core's ``Float16Module`` (16-bit parameters,
    float32 outputs on the last stage); the fp32 master weights are the optimizer's
    (:mod:`.optimizer`). ``fp32_lm_head`` (``[model] fp32_lm_head``) computes the output
    projection in float32 (:func:`fp32_output_layer`). ``sequence_parallel``: Megatron-Core's
    ``sequence_parallel`` (needs ``tp > 1``).

    Needs Megatron-Core's parallel state (:func:`.parallel.init_parallel`) and the
    compatibility patches (:mod:`.bridge_compat`, :mod:`.cpu_compat`) applied.
    """
    from megatron.core.transformer.module import Float16Module

    tp, pp, ep = sizes
    # ``torch_dtype`` (the bridge's own argument), not ``dtype``: other keywords are kept for
    # loading the tokenizer and config, whose save_pretrained in save_hf cannot serialise a dtype.
    bridge = auto_bridge.from_hf_pretrained(model_path, torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    # Megatron-Bridge turns initialization off when it loads weights, but Megatron-Core marks a
    # tensor-parallel shard (``tensor_model_parallel``, partition dim) only while initializing
    # it; unmarked shards would count as replicas in the optimizer's gradient norm under TP > 1.
    # Initialize (cheap next to training), then the bridge's load overwrites the values.
    provider.perform_initialization = True
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.virtual_pipeline_model_parallel_size = options.virtual_stages
    if options.virtual_stages:
        interleaved_p2p(provider)
    provider.context_parallel_size = int(options.cp)
    provider.expert_model_parallel_size = ep
    provider.expert_tensor_parallel_size = options.expert_tp(tp)
    provider.params_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    provider.hidden_dropout = provider.attention_dropout = 0.0
    provider.sequence_parallel = bool(sequence_parallel) and tp > 1
    # The host's loss is already divided by the mini-batch's global norm: Megatron DDP must sum
    # the data-parallel gradients (gradient scaling factor 1), not average them.
    provider.calculate_per_token_loss = True
    configure_recompute(provider, options)
    if num_experts:
        _configure_moe(provider, hf_config, options, num_experts)
        if router_replay:
            # Transformer Engine's fused top-k never asks the router's replay object
            provider.moe_router_fusion = False
    cpu_compat.configure_provider(provider)
    provider.finalize()
    vocab_size = int(provider.vocab_size)
    modules = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=device.type == "cpu",
        mixed_precision_wrapper=Float16Module if dtype != torch.float32 else None)
    if fp32_lm_head and dtype != torch.float32:
        for module in modules:
            fp32_output_layer(module)
    return BuiltModel(bridge=bridge, modules=modules, vocab_size=vocab_size)


def interleaved_p2p(provider: Any) -> None:
    """Point-to-point exchanges the interleaved schedule (``backend_args.vpp``) can match up:
    Megatron-Core's ``batch_p2p_comm = False``.

    The interleaved schedule sends activations forward and gradients backward in one exchange. In
    a batched exchange (``_batched_p2p_ops``) every rank posts send-to-previous, receive-from-
    previous, send-to-next, receive-from-next; under ``pp = 2`` the previous and the next stage
    are the same rank, so with Gloo, which matches a pair's messages in the order they were
    posted, a rank's first send (a gradient) meets its peer's first receive (an activation of the
    same shape) and the stages silently swap them. Megatron-Core's unbatched exchange
    (``_p2p_ops``) orders the sends and receives by even and odd stage, so each meets its own.
    """
    provider.batch_p2p_comm = False


def configure_recompute(provider: Any, options: BackendOptions) -> None:
    """Megatron-Core's activation recomputation, as ``backend_args`` sets it (checked beforehand by
    :func:`.layout.check_recompute`): ``recompute_granularity``, ``recompute_method`` and
    ``recompute_num_layers`` of the ``TransformerConfig``. ``"selective"`` keeps Megatron-Core's
    default ``recompute_modules`` (the core attention). Megatron-Core recomputes only in training
    (a module in train mode, under autograd), so forward-only passes run as before."""
    provider.recompute_granularity = options.recompute_granularity
    provider.recompute_method = options.recompute_method
    provider.recompute_num_layers = options.recompute_num_layers


def fp32_output_layer(module: Any) -> int:
    """Compute the output projection (the logits) of ``module``'s last pipeline stage in float32;
    returns how many output layers it changed (0 on other stages).

    Megatron-Core's ``GPTModel`` calls ``output_layer(hidden, weight=output_weight)`` (a
    ``ColumnParallelLinear``; ``output_weight`` is the embedding under tied embeddings, else the
    layer's own weight). The layer's forward is wrapped to run the same upstream forward on the
    float32 upcast of the hidden states and of that weight, so the matmul and its logits are
    float32 (as the torch backend's ``fp32_lm_head``). The weight stays a 16-bit parameter: its
    gradient flows back through the upcast, and Megatron DDP accumulates it in its float32
    gradient buffer. ``gradient_accumulation_fusion`` is turned off for that layer (the fused
    kernel would write into the upcast copy's missing ``main_grad``).
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear

    changed = 0
    for sub in module.modules():
        layer = getattr(sub, "output_layer", None)
        if not isinstance(layer, ColumnParallelLinear) or getattr(layer, "_loongsage_fp32", False):
            continue
        if layer.bias is not None:
            raise ValueError("[model] fp32_lm_head: the model's output layer has a bias, which the megatron "
                             "backend does not compute in float32")
        layer.gradient_accumulation_fusion = False
        upstream = layer.forward

        def forward(input_: torch.Tensor, weight: torch.Tensor | None = None,
                    runtime_gather_output: bool | None = None, _layer: Any = layer,
                    _upstream: Any = upstream) -> Any:
            weight = _layer.weight if weight is None else weight
            return _upstream(input_.float(), weight=weight.float(), runtime_gather_output=runtime_gather_output)

        layer.forward = forward
        layer._loongsage_fp32 = True
        changed += 1
    return changed


def _configure_moe(provider: Any, hf_config: dict[str, Any], options: BackendOptions, num_experts: int) -> None:
    """Mixture-of-Experts settings of the provider (expert parallelism is set with the other sizes).

    The load-balancing loss is off unless ``backend_args.moe_aux_loss_coeff`` > 0 (the
    bridge's default coefficient would add its gradient to the RL loss's); see
    :func:`aux_loss_scale` for how a positive coefficient is normalised.
    """
    if not provider.num_moe_experts:
        raise ValueError(f"[model] path: config.json names {num_experts} experts but Megatron-Bridge built "
                         "a dense model from it")
    provider.moe_aux_loss_coeff = float(options.moe_aux_loss_coeff)
    bridge_compat.configure_router(provider, hf_config)


def aux_loss_scale(inputs: list[Any], dp: int, device: torch.device) -> float:
    """The factor Megatron's per-micro-batch load-balancing loss gets under this backend's loss.

    With ``calculate_per_token_loss`` Megatron attaches each micro-batch's load-balancing
    loss times its number of routed tokens and expects ``finalize_model_grads`` to divide all
    gradients by the mini-batch's token count; this backend does not divide (the host's loss
    is normalised already). Scaling the coefficient by 1 / (tokens routed in the whole
    mini-batch, over all micro-batches and data-parallel ranks) gives the gradient of
    ``moe_aux_loss_coeff`` times the token-weighted mean load-balancing loss of every MoE layer.
    """
    tokens = torch.tensor([float(sum(i.input_ids.numel() for i in inputs))], dtype=torch.float64, device=device)
    sum_over_data_parallel(tokens, dp)
    return 1.0 / max(float(tokens.item()), 1.0)
