"""LoRA on the megatron backend: Megatron-Bridge's own PEFT, in the layout PEFT saves.

``[train] lora`` wraps the policy's linear layers with Megatron-Bridge's ``CanonicalLoRA``: one
adapter per Hugging Face projection (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``), although Megatron-Core fuses q/k/v and gate/up into
one linear layer each. Every adapter is then exactly one PEFT ``lora_A`` / ``lora_B`` pair of the
same module, with PEFT's update ``alpha / rank * B @ A``, dropout on the adapter's input and
PEFT's initialisation (``A`` Kaiming-uniform, ``B`` zero: the wrapped model starts equal to the
base). Megatron-Bridge exports the adapter under Hugging Face names, gathered over tensor
parallelism and from every pipeline stage (:func:`adapter_weights`); this module adds PEFT's
``base_model.model.`` prefix, so what the trainer sends to the engines, exports and what the
torch backend sends are one set of names (:mod:`loongsage_hookspecs.lora`).

Megatron-Core, Megatron-Bridge and peft are imported inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from loongsage_hookspecs import LORA_ALL_LINEAR, LORA_PEFT_PREFIX, LORA_TENSOR_SUFFIXES, LoraSettings

HF_TO_CANONICAL = {"q_proj": "linear_q", "k_proj": "linear_k", "v_proj": "linear_v", "o_proj": "linear_proj",
                   "gate_proj": "linear_fc1_gate", "up_proj": "linear_fc1_up", "down_proj": "linear_fc2"}
"""Hugging Face projection -> ``CanonicalLoRA`` target (Megatron-Core's layer, or its q/k/v or gate/up part)."""


def canonical_targets(target_modules: list[str]) -> list[str]:
    """``CanonicalLoRA`` targets of ``[train] lora.target_modules`` (Hugging Face projection names,
    or ``["all-linear"]``: every projection of the decoder layers, not the output layer)."""
    names = list(target_modules)
    if names == [LORA_ALL_LINEAR]:
        return list(HF_TO_CANONICAL.values())
    unknown = [name for name in names if name not in HF_TO_CANONICAL]
    if unknown or not names:
        raise ValueError(f"[train] lora.target_modules = {names!r}: the megatron backend adapts the decoder "
                         f"layers' projections {sorted(HF_TO_CANONICAL)} or 'all-linear'"
                         + (f"; unknown: {unknown}" if unknown else ""))
    return [HF_TO_CANONICAL[name] for name in names]


def apply_lora(modules: list[Any], settings: LoraSettings, num_experts: int | None = None) -> Any:
    """Wrap the linear layers of the model chunks ``modules`` (in place) in LoRA adapters and
    freeze every other parameter; returns the ``CanonicalLoRA`` (its ``disable_adapter(modules)``
    is the base model: the KL reference). ``num_experts``: the model's routed experts, if any."""
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA

    if num_experts:
        raise ValueError("megatron train backend: [train] lora on a Mixture-of-Experts model is not supported "
                         "yet (dense models only)")

    lora = CanonicalLoRA(target_modules=canonical_targets(settings.target_modules), dim=int(settings.rank),
                         alpha=float(settings.alpha),  # type: ignore[arg-type]  # the ratio alpha / dim is what counts
                         dropout=float(settings.dropout), dropout_position="pre",
                         lora_A_init_method="kaiming", lora_B_init_method="zero")
    lora(modules, training=True)
    if not any(p.requires_grad for module in modules for p in module.parameters()):
        raise ValueError(f"[train] lora.target_modules = {list(settings.target_modules)!r} matched no layer of "
                         "the model")
    return lora


def trainable_names(module: Any) -> set[str]:
    """Names (in ``module.state_dict()``) of the parameters that train: the adapter's."""
    return {name for name, param in module.named_parameters() if param.requires_grad}


def adapter_state(module: Any) -> dict[str, torch.Tensor]:
    """The adapter's part of ``module.state_dict()`` (what a LoRA checkpoint holds of the model)."""
    keep = trainable_names(module)
    return {name: tensor for name, tensor in module.state_dict().items() if name in keep}


def load_adapter_state(module: Any, state: dict[str, torch.Tensor], source: str) -> None:
    """Load what :func:`adapter_state` returned into ``module``; ValueError naming ``source`` when
    its adapter tensors are not exactly this model's."""
    current = adapter_state(module)
    missing, extra = sorted(set(current) - set(state)), sorted(set(state) - set(current))
    reshaped = sorted(name for name in set(state) & set(current) if state[name].shape != current[name].shape)
    if missing or extra or reshaped:
        raise ValueError(f"MegatronTrainWorker.load_checkpoint: '{source}' holds another adapter than this "
                         f"job's [train] lora (missing {missing[:3]}, unexpected {extra[:3]}, "
                         f"other shapes {reshaped[:3]})")
    module.load_state_dict(state, strict=False)


def adapter_weights(bridge: Any, modules: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's full tensors under PEFT's saved names, sorted by name, on every rank."""
    with torch.no_grad():
        weights = {LORA_PEFT_PREFIX + name: tensor
                   for name, tensor in bridge.export_adapter_weights(modules, cpu=True, show_progress=False)}
    for name in sorted(weights):
        yield name, weights[name]


def save_adapter(path: str | Path, weights: dict[str, torch.Tensor], settings: LoraSettings,
                 base_model: str) -> None:
    """Write a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained(base_model, path)`` loads."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    lora_a = LORA_TENSOR_SUFFIXES[0]
    modules = sorted({name[: -len(lora_a)].rsplit(".", 1)[-1] for name in weights if name.endswith(lora_a)})
    config = LoraConfig(r=int(settings.rank), lora_alpha=float(settings.alpha), lora_dropout=float(settings.dropout),
                        target_modules=modules, bias="none", task_type="CAUSAL_LM",
                        base_model_name_or_path=base_model)
    config.save_pretrained(str(out))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
