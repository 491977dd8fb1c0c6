"""Megatron-Bridge's expert naming, extended to Megatron-Core's ``SequentialMLP``; its tied
embeddings under virtual pipeline stages.

Megatron-Core builds a Mixture-of-Experts layer's experts either as one grouped module
(``TEGroupedMLP`` / ``GroupedMLP``: parameters ``mlp.experts.linear_fc1.weight{e}``) or, without
Transformer Engine and the grouped-GEMM kernels, as ``SequentialMLP``: one MLP per local expert,
``mlp.experts.local_experts.{e}.linear_fc1.weight``. Under expert parallelism ``e`` is the
expert's index on its own expert-parallel rank. Megatron-Bridge's mapping registries list both
spellings, but three helpers of its conversion only read the expert index from the grouped one:

* ``megatron.bridge.models.conversion.model_bridge._megatron_local_name_to_global`` turns a
  rank's local parameter names into global ones (layer and expert numbers). It leaves
  ``local_experts.{e}`` local, so the rank holding experts ``E/ep .. 2E/ep - 1`` loads Hugging
  Face experts ``0 .. E/ep - 1`` (silently wrong weights);
* ``MegatronParamMapping.gather_from_ep_ranks`` (``megatron.bridge.models.conversion.param_mapping``)
  reads the expert number from the digits after ``.weight`` and fails on ``int('')`` when it
  exports a ``SequentialMLP`` weight, at any expert-parallel size;
* ``extract_sort_key`` (the order of the conversion tasks, which must pair up across
  expert-parallel ranks, as imported by ``model_bridge``) ignores ``local_experts.{e}``, so names
  are ordered as strings: where one rank's global expert numbers have different digit counts
  (experts 8-15: "10" sorts before "8") the ranks' tasks would pair different local experts in
  the export's all-gather.

:func:`apply` extends each of them to ``local_experts.{e}`` and leaves every other name to the
upstream code unchanged. Loading, conversion and export themselves stay Megatron-Bridge's.

With tied input and output embeddings under pipeline parallelism the bridge loads the embedding
on the first stage and copies it into the last stage's output layer
(``MegatronModelBridge._broadcast_shared_embeddings``). Under virtual pipeline stages
(``backend_args.vpp``) it reads the rank's first model chunk on both, but the last stage's output
layer is in its last chunk: :func:`apply` hands it that chunk (:func:`_tied_embeddings_under_vpp`).

:func:`configure_router` fills in one setting its Qwen3-MoE config translation leaves out
(``norm_topk_prob``).
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

# ``<prefix>.mlp.experts.local_experts.<e>.<rest>`` (SequentialMLP), e.g.
# ``decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight``.
_SEQUENTIAL_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.local_experts\.(?P<expert>\d+)\.(?P<rest>.+)$")


def sequential_expert(name: str) -> tuple[str, int, str] | None:
    """``(prefix, expert index, rest)`` of a ``SequentialMLP`` expert parameter name, else None."""
    match = _SEQUENTIAL_EXPERT.match(name)
    if match is None:
        return None
    return match["prefix"], int(match["expert"]), match["rest"]


def _global_expert_name(name: str, config: Any) -> str:
    """``name`` with a ``local_experts.{e}`` index turned global under expert parallelism."""
    from megatron.core import parallel_state

    parts = sequential_expert(name)
    if parts is None or ".adapter." in name:  # adapters are not sharded over experts upstream either
        return name
    group = parallel_state.get_expert_model_parallel_group()
    size = group.size() if group is not None else 1
    if size <= 1:
        return name
    prefix, local, rest = parts
    per_rank = int(config.num_moe_experts) // size
    return f"{prefix}.local_experts.{per_rank * group.rank() + local}.{rest}"


def _grouped_spelling(name: str) -> str:
    """The grouped spelling of a ``SequentialMLP`` expert name (``experts.linear_fc1.weight{e}``)."""
    parts = sequential_expert(name)
    if parts is None:
        return name
    prefix, expert, rest = parts
    return f"{prefix}.{rest}{expert}"


def _extend_local_name_to_global() -> None:
    from megatron.bridge.models.conversion import model_bridge

    upstream = model_bridge._megatron_local_name_to_global
    if getattr(upstream, "_loongsage_sequential_experts", False):
        return

    @functools.wraps(upstream)
    def local_name_to_global(models: Any, config: Any, param_name: str, vp_stage: Any = None) -> str:
        return _global_expert_name(upstream(models, config, param_name, vp_stage), config)

    local_name_to_global._loongsage_sequential_experts = True  # type: ignore[attr-defined]
    # Module attribute: model_bridge's own calls and peft_bridge's function-level import read it.
    model_bridge._megatron_local_name_to_global = local_name_to_global


def _extend_ep_gather() -> None:
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    upstream = MegatronParamMapping.gather_from_ep_ranks
    if getattr(upstream, "_loongsage_sequential_experts", False):
        return

    @functools.wraps(upstream)
    def gather_from_ep_ranks(self: Any, megatron_weights: Any, megatron_module: Any, hf_param_name: Any) -> Any:
        if sequential_expert(self.megatron_param) is None:
            return upstream(self, megatron_weights, megatron_module, hf_param_name)
        # Upstream reads the (global) expert number from the grouped spelling only: hand it a
        # copy of this mapping under that spelling; the gather itself is unchanged.
        grouped = copy.copy(self)
        grouped.megatron_param = _grouped_spelling(self.megatron_param)
        return upstream(grouped, megatron_weights, megatron_module, hf_param_name)

    gather_from_ep_ranks._loongsage_sequential_experts = True  # type: ignore[attr-defined]
    MegatronParamMapping.gather_from_ep_ranks = gather_from_ep_ranks  # type: ignore[method-assign]


def _extend_sort_key() -> None:
    from megatron.bridge.models.conversion import model_bridge

    upstream = model_bridge.extract_sort_key
    if getattr(upstream, "_loongsage_sequential_experts", False):
        return

    @functools.wraps(upstream)
    def extract_sort_key(param_name: str) -> Any:
        # The grouped spelling carries the expert number where upstream looks for it; the name
        # itself stays the tie-breaker, so the order is (layer, expert, name) for both spellings.
        numbers, _ = upstream(_grouped_spelling(param_name))
        return numbers, param_name

    extract_sort_key._loongsage_sequential_experts = True  # type: ignore[attr-defined]
    model_bridge.extract_sort_key = extract_sort_key


def configure_router(provider: Any, hf_config: dict[str, Any]) -> None:
    """Fill in a router setting Megatron-Bridge's Qwen3-MoE config translation leaves out.

    ``Qwen3MoEBridge.provider_bridge`` always sets ``moe_router_pre_softmax = False`` (softmax
    over the top-k logits: the top-k probabilities renormalised), which is Hugging Face's
    ``norm_topk_prob = true`` (the released Qwen3-MoE checkpoints). A config with
    ``norm_topk_prob = false`` (the transformers default) weighs the experts by their plain
    softmax probabilities: Megatron's ``moe_router_pre_softmax = True``.
    """
    if hf_config.get("model_type") == "qwen3_moe":
        provider.moe_router_pre_softmax = not bool(hf_config.get("norm_topk_prob", False))


def _tied_embeddings_under_vpp() -> None:
    """Replace ``MegatronModelBridge._broadcast_shared_embeddings`` (``megatron.bridge.models.conversion.
    model_bridge``) for several model chunks per rank.

    Upstream broadcasts the first pipeline stage's embedding into the last stage's output layer,
    reading both from ``unwrap_model(chunks)[0]`` (its own comment marks virtual pipelines as not
    handled): on the last stage under virtual pipeline stages that chunk has no output layer
    (upstream asserts). The replacement runs upstream on the chunk that holds the tied weight: the
    first chunk on the first stage, the last chunk elsewhere (the output layer's, on the last stage).
    """
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.core import parallel_state

    upstream = MegatronModelBridge._broadcast_shared_embeddings
    if getattr(upstream, "_loongsage_vpp", False):
        return

    @functools.wraps(upstream)
    def broadcast(self: Any, megatron_model: Any) -> None:
        if isinstance(megatron_model, list) and len(megatron_model) > 1 and \
                not parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            megatron_model = megatron_model[-1:]
        upstream(self, megatron_model)

    broadcast._loongsage_vpp = True  # type: ignore[attr-defined]
    MegatronModelBridge._broadcast_shared_embeddings = broadcast  # type: ignore[method-assign]


def apply() -> None:
    """Extend Megatron-Bridge's expert naming to ``SequentialMLP`` and its tied-embedding load to
    virtual pipeline stages (idempotent; see the module docstring)."""
    _extend_local_name_to_global()
    _extend_ep_gather()
    _extend_sort_key()
    _tied_embeddings_under_vpp()
