"""Checkpoints and Hugging Face export of the megatron train backend.

A checkpoint holds, per rank (:data:`STATE_FILE`), the model shard (the state dict of its model
chunk, or under ``backend_args.vpp`` the list of its chunks' state dicts), the Megatron optimizer's
``state_dict()``, the learning-rate schedule, the step and the RNG state; under the distributed
optimizer the sharded Adam state goes to one more file per model-parallel rank
(:data:`PARAM_STATE_FILE`, ``save_parameter_state``, gathered on data-parallel rank 0). A run
resumed from it continues exactly (same parallel layout and optimizer kind). Under bfloat16 /
float16 the model shard is 16-bit and the optimizer's state holds the float32 master weights
(``fp32_from_fp16_params``) and, under float16, the loss scaler.

Hugging Face weights are Megatron-Bridge's export: full tensors under Hugging Face names,
gathered over tensor parallelism and broadcast from the pipeline stage that holds them, in the
model's dtype (the 16-bit parameters under bfloat16 / float16, not the float32 master weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from loongsage_core.backend_api.files import save_torch_atomically

from . import lora as lora_lib
from .parallel import model_parallel_rank

STATE_FILE = "megatron_state_rank{rank}.pt"
# The distributed optimizer's parameter state, written by data-parallel rank 0 of each model-parallel rank.
PARAM_STATE_FILE = "megatron_optimizer_params_mp{rank}.pt"
CHECKPOINT_FORMAT = 2


def save_checkpoint(path: str, *, rank: int, role: str, step: int, modules: list[Any], optimizer: Any,
                    scheduler: Any, distributed_optimizer: bool, adapter_only: bool = False) -> None:
    """Write this rank's model chunks ``modules`` (with ``adapter_only``, a LoRA run, their adapter
    alone: the base weights come from ``[model] path`` again), ``optimizer`` and ``scheduler``
    (None for a forward-only worker), ``step`` and RNG state under ``path``; every rank waits for all."""
    import torch.distributed as dist

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {"format": CHECKPOINT_FORMAT, "role": role, "step": step,
             "model": model_state(modules, adapter_only), "adapter_only": adapter_only,
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "rng": torch.get_rng_state()}
    save_torch_atomically(state, out / STATE_FILE.format(rank=rank))  # a full disk: an OSError naming the file
    if optimizer is not None and distributed_optimizer:
        optimizer.save_parameter_state(str(out / PARAM_STATE_FILE.format(rank=model_parallel_rank())))
    if dist.is_initialized():
        dist.barrier()


def model_state(modules: list[Any], adapter_only: bool) -> Any:
    """What a checkpoint holds of the model chunks ``modules``: one chunk's state dict (its
    adapter's with ``adapter_only``), or the list of every chunk's under virtual pipeline stages."""
    states = [lora_lib.adapter_state(module) if adapter_only else module.state_dict() for module in modules]
    return states[0] if len(states) == 1 else states


def load_model_state(modules: list[Any], saved: Any, adapter_only: bool, source: str) -> None:
    """Load what :func:`model_state` returned into ``modules``; ValueError naming ``source`` when
    it holds another number of model chunks (another ``backend_args.vpp``)."""
    states = saved if isinstance(saved, list) else [saved]
    if len(states) != len(modules):
        raise ValueError(f"MegatronTrainWorker.load_checkpoint: '{source}' holds {len(states)} model chunk(s) per "
                         f"rank, this worker has {len(modules)} (the checkpoint was saved with another "
                         "[train] backend_args.vpp)")
    for module, state in zip(modules, states):
        if adapter_only:
            lora_lib.load_adapter_state(module, state, source)
        else:
            module.load_state_dict(state)


def load_checkpoint(path: str, *, rank: int, modules: list[Any], optimizer: Any, scheduler: Any,
                    distributed_optimizer: bool, adapter_only: bool = False) -> int:
    """Restore what :func:`save_checkpoint` wrote into ``modules``, ``optimizer``, ``scheduler`` and
    the RNG; returns the saved step. FileNotFoundError / ValueError name the checkpoint at fault."""
    src = Path(path) / STATE_FILE.format(rank=rank)
    if not src.is_file():
        raise FileNotFoundError(f"MegatronTrainWorker.load_checkpoint: no {src.name} in checkpoint directory "
                                f"'{Path(path).resolve()}'")
    state = torch.load(src, map_location="cpu", weights_only=False)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"MegatronTrainWorker.load_checkpoint: '{src}' has format {state.get('format')!r}, "
                         f"expected {CHECKPOINT_FORMAT} (Megatron optimizer state)")
    if bool(state.get("adapter_only", False)) != adapter_only:
        saved = "a LoRA adapter" if state.get("adapter_only") else "full weights"
        raise ValueError(f"MegatronTrainWorker.load_checkpoint: '{src}' holds {saved}, but this job "
                         f"{'trains' if adapter_only else 'has no'} [train] lora")
    load_model_state(modules, state["model"], adapter_only, str(src))
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError(f"MegatronTrainWorker.load_checkpoint: '{src}' holds no optimizer state "
                             f"(saved by a {state.get('role')!r} worker)")
        optimizer.load_state_dict(state["optimizer"])
        if distributed_optimizer:
            params = Path(path) / PARAM_STATE_FILE.format(rank=model_parallel_rank())
            optimizer.load_parameter_state(str(params))
        scheduler.load_state_dict(state["scheduler"])
    step = int(state["step"])
    torch.set_rng_state(state["rng"])
    return step


def export_hf_weights(bridge: Any, modules: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors of ``modules`` under Hugging Face names, on every rank.

    The bridge gathers them over tensor parallelism and, under PP > 1, broadcasts each from
    the pipeline stage that holds it. Without autograd: the broadcasts write parameters'
    storage, which must not enter the next training step's graph.
    """
    yield from _without_grad(bridge.export_hf_weights(modules, cpu=True, show_progress=False))


def save_hf(bridge: Any, modules: list[Any], path: str, *, rank: int, tokenizer_source: str) -> None:
    """Write a Hugging Face directory (config, safetensors; rank 0 adds the tokenizer of
    ``tokenizer_source`` when it has one) through Megatron-Bridge; every rank waits for all."""
    import torch.distributed as dist

    with torch.no_grad():  # see export_hf_weights
        bridge.save_hf_pretrained(modules, path, show_progress=False)
    if rank == 0:
        from transformers import AutoTokenizer

        try:
            AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(path)
        except (OSError, ValueError):
            pass  # a model directory without tokenizer files: weights and config only
    if dist.is_initialized():
        dist.barrier()


def _without_grad(items: Iterator[Any]) -> Iterator[Any]:
    """``items`` advanced under ``torch.no_grad()``, the caller's grad mode untouched between items."""
    while True:
        with torch.no_grad():
            try:
                item = next(items)
            except StopIteration:
                return
        yield item
