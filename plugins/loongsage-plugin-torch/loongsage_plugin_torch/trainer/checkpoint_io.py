"""A torch train worker's checkpoint directory: what it holds, how it is written and read back.

Rank 0 writes ``trainer_state.pt`` (model or LoRA adapter, optimizer, LR schedule, step); every
rank writes ``rng_rank{rank}.pt`` (its generators, captured by :mod:`.checkpoint`). The file
names, the format number and the atomic write live here, with :class:`CheckpointMixin`, so that
the policy (:class:`~.worker.TorchTrainWorker`) and the critic (:class:`~.critic.TorchCriticWorker`)
share one layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loongsage_core.backend_api.files import save_torch_atomically

from . import distributed
from .checkpoint import capture_rng, restore_rng, seed_everything

STATE_FILE = "trainer_state.pt"
RNG_FILE = "rng_rank{rank}.pt"
CHECKPOINT_FORMAT = 1
ADAPTER_ONLY = "adapter"
"""``trainer_state.pt`` ``"weights"`` value of a LoRA run's checkpoint (its model entry is the adapter)."""


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, then rename over ``path``: a crash leaves no half-written
    file, and a full disk is an ``OSError`` (``ENOSPC``) naming ``path`` (:func:`save_torch_atomically`)."""
    save_torch_atomically(obj, path)


def load_checkpoint_file(path: Path) -> Any:
    """``torch.load`` of a checkpoint file; an unreadable one is a ``ValueError`` naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, empty file, pickle errors: all say "this file is broken"
        raise ValueError(f"checkpoint file '{path}' cannot be read ({type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'empty'})") from None


class CheckpointMixin:
    """Saving and restoring a worker's training state; the attributes below are set by the
    worker's ``__init__``."""

    job: Any
    role: str
    rank: int
    model: Any
    peft_model: Any
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    global_step: int

    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer, LR schedule, step and every rank's RNG states under directory ``path``.

        Rank 0 writes ``trainer_state.pt``; each rank writes ``rng_rank{rank}.pt``.
        """
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            state = {"format": CHECKPOINT_FORMAT, "role": self.role, "step": self.global_step,
                     "model": self._checkpoint_weights(),
                     "weights": ADAPTER_ONLY if self.peft_model is not None else "full",
                     "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                     "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
            atomic_save(state, out / STATE_FILE)
        atomic_save(capture_rng(), out / RNG_FILE.format(rank=self.rank))
        distributed.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, so training continues bit-identically.

        A rank without its own RNG file (the run was saved with fewer ranks) is reseeded from
        ``[run] seed``, rank and step instead.
        """
        src = Path(path)
        state_file = src / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"TorchTrainWorker.load_checkpoint: no {STATE_FILE} in checkpoint directory "
                                    f"'{src.resolve()}'")
        state = load_checkpoint_file(state_file)
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"TorchTrainWorker.load_checkpoint: '{state_file}' has format {state.get('format')!r}, "
                             f"expected {CHECKPOINT_FORMAT}")
        self._load_checkpoint_weights(state, state_file)
        if self.optimizer is not None:
            if state["optimizer"] is None:
                raise ValueError(f"TorchTrainWorker.load_checkpoint: '{state_file}' holds no optimizer state "
                                 f"(saved by a {state.get('role')!r} worker)")
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["step"])
        rng_file = src / RNG_FILE.format(rank=self.rank)
        if rng_file.is_file():
            restore_rng(load_checkpoint_file(rng_file))
        else:
            seed_everything(int(self.job.run.seed) + self.rank + 1_000_003 * self.global_step)
        distributed.barrier()

    def _checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The model entry of a checkpoint: every tensor, or with LoRA the trainable adapter alone."""
        if self.peft_model is None:
            return self.model.state_dict()
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def _load_checkpoint_weights(self, state: dict[str, Any], state_file: Path) -> None:
        """Load a checkpoint's model entry; a LoRA checkpoint fits only a LoRA policy and back."""
        kind = state.get("weights", "full")
        mine = ADAPTER_ONLY if self.peft_model is not None else "full"
        if kind != mine:
            raise ValueError(f"TorchTrainWorker.load_checkpoint: '{state_file}' holds {kind} weights but this "
                             f"policy {'trains a LoRA adapter' if mine == ADAPTER_ONLY else 'has no LoRA adapter'} "
                             "([train] lora differs from the run that saved it)")
        try:
            if self.peft_model is None:
                self.model.load_state_dict(state["model"])
                return
            expected = {name for name, p in self.model.named_parameters() if p.requires_grad}
            if set(state["model"]) != expected:
                missing, extra = sorted(expected - set(state["model"])), sorted(set(state["model"]) - expected)
                raise RuntimeError(f"adapter tensors missing: {missing[:3]}, unexpected: {extra[:3]}")
            self.model.load_state_dict(state["model"], strict=False)
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"TorchTrainWorker.load_checkpoint: '{state_file}' does not fit the model: "
                             f"{str(exc).strip().splitlines()[0]}") from None
