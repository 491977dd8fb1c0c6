"""What every backend, engine and weight transport agrees on about LoRA adapters in flight.

With ``[train] lora`` a train backend's ``named_weights()`` yields the adapter alone, under the
names PEFT saves it with (``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``, the
keys of ``adapter_model.safetensors``); engines serve it under :data:`LORA_ADAPTER_NAME`, the
``lora_path`` every generation request of a LoRA run carries (SGLang's per-request adapter name).
"""

from __future__ import annotations

LORA_ADAPTER_NAME = "policy"
"""The name the trained adapter is loaded under in every engine (SGLang's ``lora_name``)."""

LORA_TENSOR_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
"""How the names of a LoRA adapter's tensors end."""

LORA_PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a base-model module name in an adapter's tensor names."""

LORA_ALL_LINEAR = "all-linear"
"""``[train] lora.target_modules = ["all-linear"]``: every linear layer but the output layer."""


def is_lora_tensor(name: str) -> bool:
    """Whether ``name`` is a LoRA adapter tensor's name (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return name.endswith(LORA_TENSOR_SUFFIXES)
