"""Weights in and out of a torch train worker: the tensors weight transports send, the tensors a
reference update loads, and the exports (a Hugging Face directory, a PEFT adapter directory).

:class:`WeightIOMixin` is where ``[train] lora`` changes what leaves the worker:
:meth:`~WeightIOMixin.named_weights` yields the adapter alone (what engines receive),
:meth:`~WeightIOMixin.save_hf` writes the merged model and :meth:`~WeightIOMixin.save_adapter`
the adapter directory. Kept apart from the training step and the checkpoint format, which do not
depend on where the weights go.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .. import lora as lora_lib
from ..modeling import load_tokenizer
from . import distributed


class WeightIOMixin:
    """Weight access and export of a worker; the attributes below are set by the worker's ``__init__``."""

    job: Any
    rank: int
    model: Any
    peft_model: Any
    lora: Any
    compute_dtype: torch.dtype

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under Hugging Face names, floating ones in ``[model] dtype``; with
        ``[train] lora`` the adapter's tensors alone, under PEFT's names (what engines receive).

        Tied tensors are yielded once (under their first name); tensors already in the model
        dtype are the live parameters (detached, no copy), others are cast on the fly.
        """
        if self.peft_model is not None:
            for name, tensor in lora_lib.adapter_weights(self.peft_model):
                yield name, tensor.to(self.compute_dtype) if tensor.dtype != self.compute_dtype else tensor
            return
        seen: set[int] = set()
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            t = tensor.detach()
            if t.is_floating_point() and t.dtype != self.compute_dtype:
                t = t.to(self.compute_dtype)
            yield name, t

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy named tensors (Hugging Face names) into the model; returns how many were loaded."""
        state = self.model.state_dict(keep_vars=True)
        count = 0
        for name, tensor in weights:
            if name not in state:
                raise KeyError(f"TorchTrainWorker.load_weights: the model has no tensor named {name!r}")
            target = state[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"TorchTrainWorker.load_weights: {name!r} has shape {tuple(target.shape)}, "
                                 f"got {tuple(tensor.shape)}")
            target.data.copy_(tensor)
            count += 1
        return count

    def save_adapter(self, path: str) -> None:
        """Write the PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
        on rank 0; ``peft.PeftModel.from_pretrained(base_model, path)`` loads it."""
        if self.peft_model is None:
            raise RuntimeError("TorchTrainWorker.save_adapter: the policy has no LoRA adapter ([train] lora)")
        if self.rank == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            lora_lib.save_adapter(self.peft_model, path)
        distributed.barrier()

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face directory (config.json, model.safetensors, tokenizer files) on rank 0.

        Weights are saved in ``[model] dtype`` (with LoRA: the base weights with the adapter merged
        in); the tokenizer is copied when the job names one.
        ``transformers.AutoModelForCausalLM.from_pretrained(path)`` (and ``[model] path``) load it.
        """
        if self.rank == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            weights = (self.model.state_dict() if self.peft_model is None
                       else lora_lib.merged_state_dict(self.peft_model, lora_lib.lora_scaling(self.lora)))
            state = {name: t.to(self.compute_dtype) if t.is_floating_point() else t
                     for name, t in weights.items()}
            saved_dtype = getattr(self.model.config, "dtype", None)
            self.model.config.dtype = self.compute_dtype
            try:
                self.model.save_pretrained(str(out), state_dict=state)
            finally:
                self.model.config.dtype = saved_dtype
            if self.job.model.tokenizer or self.job.model.path:
                load_tokenizer(self.job).save_pretrained(str(out))
        distributed.barrier()
