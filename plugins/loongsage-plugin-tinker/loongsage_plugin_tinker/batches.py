"""Tinker datums as LoongSage training batches, and per-token results back as arrays.

A Tinker datum is ``model_input`` (N tokens) with per-position ``loss_fn_inputs``: ``target_tokens``
(the token predicted at each position, the next input token) and the loss's own inputs
(``weights``, ``advantages``, ``logprobs``), all of length N. A LoongSage batch row scores each of
its tokens from the tokens before it, so the row is the input followed by the last target
(N + 1 tokens) and position ``i`` of the datum is row position ``i + 1``. Targets that are not the
next input token cannot be scored that way and are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import attrs
import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from loongsage_hookspecs import Batch


class TinkerRequestError(ValueError):
    """A request the service cannot run, said in one line (reported to the SDK as a user error)."""


@attrs.define
class Datum:
    """One decoded datum: its input tokens and its ``loss_fn_inputs`` as flat numpy arrays."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


REQUIRED_INPUTS = {"cross_entropy": ("target_tokens", "weights"),
                   "importance_sampling": ("target_tokens", "logprobs", "advantages"),
                   "ppo": ("target_tokens", "logprobs", "advantages")}
"""The ``loss_fn_inputs`` each loss needs (``forward`` needs only ``target_tokens``)."""


def check_datums(datums: Sequence[Datum], loss_fn: str, *, forward_only: bool) -> None:
    """Every datum has the inputs ``loss_fn`` needs (a forward pass only ``target_tokens``), of its
    length, and targets that are the next input tokens; raises :class:`TinkerRequestError` naming
    the datum and key otherwise. Inputs the loss does not read are left alone (a client-side
    custom loss may carry its own)."""
    used = REQUIRED_INPUTS[loss_fn]
    needed = ("target_tokens",) if forward_only else used
    for i, datum in enumerate(datums):
        n = len(datum.tokens)
        if n == 0:
            raise TinkerRequestError(f"data[{i}].model_input is empty")
        for key in needed:
            if key not in datum.inputs:
                raise TinkerRequestError(f"data[{i}].loss_fn_inputs has no {key!r}, which loss_fn {loss_fn!r} needs")
        for key, value in datum.inputs.items():
            if key in used and (value.ndim != 1 or value.shape[0] != n):
                raise TinkerRequestError(f"data[{i}].loss_fn_inputs[{key!r}] has shape {list(value.shape)}; "
                                         f"expected [{n}] (one value per model_input token)")
        targets = datum.inputs["target_tokens"].astype(np.int64)
        if n > 1 and not np.array_equal(targets[:-1], np.asarray(datum.tokens[1:], dtype=np.int64)):
            raise TinkerRequestError(f"data[{i}]: target_tokens must be model_input shifted by one token (the next "
                                     "token at each position); other targets are not supported")


def make_batch(datums: Sequence[Datum], loss_fn: str, pad_id: int) -> "Batch":
    """The right-padded batch of ``datums`` for ``loss_fn`` (see the module docstring)."""
    import torch

    from loongsage_hookspecs import Batch

    width = max(len(d.tokens) for d in datums) + 1
    rows = len(datums)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.float32)
    coef = torch.zeros((rows, width), dtype=torch.float32)
    sampled = torch.zeros((rows, width), dtype=torch.float32)
    for r, datum in enumerate(datums):
        n = len(datum.tokens)
        ids[r, :n] = torch.tensor(datum.tokens, dtype=torch.long)
        ids[r, n] = int(datum.inputs["target_tokens"][-1])
        attention[r, :n + 1] = 1
        mask[r, 1:n + 1] = 1.0
        key = "weights" if loss_fn == "cross_entropy" else "advantages"
        if key in datum.inputs:
            coef[r, 1:n + 1] = torch.from_numpy(datum.inputs[key].astype(np.float32))
        if "logprobs" in datum.inputs:
            sampled[r, 1:n + 1] = torch.from_numpy(datum.inputs["logprobs"].astype(np.float32))
    return Batch(tensors={"input_ids": ids, "attention_mask": attention, "loss_mask": mask,
                          "advantages": coef, "old_logprobs": sampled})


def per_datum(values: Any, datums: Sequence[Datum]) -> list[np.ndarray]:
    """Row tensor ``[B, T]`` of per-token values -> one float32 array per datum (its N positions)."""
    out = []
    for r, datum in enumerate(datums):
        n = len(datum.tokens)
        out.append(values[r, 1:n + 1].detach().float().cpu().numpy().astype(np.float32))
    return out


def datum_loss(loss_fn: str, datum: Datum, logprobs: np.ndarray, config: dict[str, float]) -> float:
    """The datum's share of the Tinker loss at the current weights (reported as ``loss:sum``).

    A forward pass may lack the loss's inputs: cross_entropy then weighs every token 1, the
    policy-gradient losses count 0."""
    lp = logprobs.astype(np.float64)
    if loss_fn == "cross_entropy":
        weights = datum.inputs.get("weights")
        return float(-(lp if weights is None else weights.astype(np.float64) * lp).sum())
    if "advantages" not in datum.inputs or "logprobs" not in datum.inputs:
        return 0.0
    adv = datum.inputs["advantages"].astype(np.float64)
    ratio = np.exp(lp - datum.inputs["logprobs"].astype(np.float64))
    if loss_fn == "importance_sampling":
        return float(-(ratio * adv).sum())
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    return float(-np.minimum(ratio * adv, np.clip(ratio, low, high) * adv).sum())
