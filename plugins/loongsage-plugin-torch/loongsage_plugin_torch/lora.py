"""LoRA with PEFT: wrapping a model in an adapter, reading and saving the adapter, merging it.

``[train] lora`` (:class:`loongsage_hookspecs.LoraSettings`) turns training into LoRA training:
:func:`apply_lora` wraps the transformers model with a PEFT LoRA adapter (only its weights
train). The adapter travels under the names PEFT saves it with (``adapter_model.safetensors``:
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``), so what the trainer sends to
the engines, checkpoints and exports is one set of tensors. :func:`merge_weight` is the one
formula of a merged weight, used by the HF export (``final_hf/``) and the embedded engine alike.

torch and peft are imported inside the functions: importing this module is cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from loongsage_hookspecs import LORA_ALL_LINEAR, LORA_PEFT_PREFIX, LORA_TENSOR_SUFFIXES, LoraSettings, is_lora_tensor

if TYPE_CHECKING:  # pragma: no cover
    import torch

LORA_SUFFIXES = LORA_TENSOR_SUFFIXES
ADAPTER_DIR = "final_adapter"
"""Where ``loongsage run`` writes the PEFT adapter directory at the end of a LoRA run."""


def lora_scaling(settings: LoraSettings) -> float:
    """The factor of the adapter's update ``scaling * B @ A``: ``alpha / rank``."""
    return float(settings.alpha) / float(settings.rank)


def peft_config(settings: LoraSettings) -> Any:
    """The ``peft.LoraConfig`` of ``settings`` (a causal LM's adapter, no bias terms)."""
    from peft import LoraConfig

    targets = list(settings.target_modules)
    return LoraConfig(r=int(settings.rank), lora_alpha=float(settings.alpha), lora_dropout=float(settings.dropout),
                      target_modules=LORA_ALL_LINEAR if targets == [LORA_ALL_LINEAR] else targets, bias="none",
                      task_type="CAUSAL_LM")


def apply_lora(model: Any, settings: LoraSettings) -> Any:
    """Wrap the transformers causal LM ``model`` in a PEFT LoRA adapter; returns the PEFT model.

    Only the adapter's parameters require gradients afterwards. ``lora_B`` starts at zero
    (PEFT's default), so the wrapped model computes exactly what ``model`` did. Module names that
    match no linear layer, or match layers that are not linear, are an error naming them.
    """
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    try:
        wrapped = get_peft_model(model, peft_config(settings))
    except ValueError as exc:  # PEFT: "Target modules {...} not found in the base model"
        raise ValueError(f"[train] lora.target_modules = {list(settings.target_modules)!r}: "
                         f"{str(exc).splitlines()[0]}") from None
    odd = sorted(name for name, module in wrapped.named_modules()
                 if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear))
    if odd:
        raise ValueError(f"[train] lora.target_modules = {list(settings.target_modules)!r} names layers that are "
                         f"not linear (LoRA here adapts linear layers only): {', '.join(odd[:4])}")
    return wrapped


def is_adapter_tensor(name: str) -> bool:
    """Whether ``name`` is a LoRA adapter tensor's name (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return is_lora_tensor(name)


def adapter_target(name: str) -> tuple[str, str]:
    """``(base weight name, "A" or "B")`` of an adapter tensor name: the Hugging Face name of the
    weight the adapter changes (``model.layers.0.self_attn.q_proj.weight``) and which factor."""
    for suffix, factor in zip(LORA_SUFFIXES, ("A", "B")):
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            if module.startswith(LORA_PEFT_PREFIX):
                module = module[len(LORA_PEFT_PREFIX):]
            return module + ".weight", factor
    raise ValueError(f"'{name}' is not a LoRA adapter tensor name (it ends with neither of {LORA_SUFFIXES})")


def adapter_weights(model: Any) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The adapter's tensors of the PEFT model ``model`` under PEFT's saved names (detached live
    tensors, no copy), sorted by name so every sender and checkpoint lists them alike."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    for name in sorted(state):
        yield name, state[name].detach()


def merge_weight(base: "torch.Tensor", lora_a: "torch.Tensor", lora_b: "torch.Tensor",
                 scaling: float) -> "torch.Tensor":
    """``base + scaling * B @ A`` computed in float32 (one fused ``addmm``), returned in ``base``'s dtype."""
    import torch

    if base.dtype == torch.float32 and lora_a.dtype == lora_b.dtype == torch.float32:
        return torch.addmm(base, lora_b, lora_a, alpha=scaling)
    return torch.addmm(base.float(), lora_b.float(), lora_a.float(), alpha=scaling).to(base.dtype)


def merged_state_dict(model: Any, scaling: float) -> dict[str, "torch.Tensor"]:
    """The base model's state dict under its Hugging Face names with the adapter merged in
    (:func:`merge_weight` for every adapted weight); the model itself is left unchanged."""
    base = model.get_base_model()
    factors: dict[str, dict[str, "torch.Tensor"]] = {}
    for name, tensor in adapter_weights(model):
        target, factor = adapter_target(name)
        factors.setdefault(target, {})[factor] = tensor
    out: dict[str, "torch.Tensor"] = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        hf_name = name.replace(".base_layer.", ".")
        pair = factors.get(hf_name)
        out[hf_name] = merge_weight(tensor, pair["A"], pair["B"], scaling) if pair else tensor
    return out


def save_adapter(model: Any, path: str | Path) -> None:
    """Write the PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``peft.PeftModel.from_pretrained(base_model, path)`` loads."""
    model.save_pretrained(str(path))
