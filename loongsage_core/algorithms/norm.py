"""Global aggregation denominators of one mini-batch."""

from __future__ import annotations

from typing import Sequence

from loongsage_hookspecs import AggregationNorm, Batch


def compute_norm(batches: Batch | Sequence[Batch], *, world: bool = False) -> AggregationNorm:
    """The :class:`AggregationNorm` of a mini-batch, from its ``loss_mask``.

    ``batches`` is the mini-batch itself or the micro-batches it was split into (the result is
    the same). With ``world=True`` and an initialised ``torch.distributed`` process group, the
    statistics of every rank's shard are combined (token and sequence counts summed, the longest
    response maxed), so each rank gets the denominators of the whole mini-batch. A controller
    that computes the norm on the unsharded mini-batch leaves ``world`` off.

    ``num_tokens`` counts trained tokens (nonzero mask entries: a mask that carries weights
    counts each weighted token once), ``num_sequences`` rows with at least one trained token,
    ``max_response_length`` the largest number of trained tokens in one row. Each is at least 1,
    so an aggregation over an all-masked mini-batch is 0, not NaN. This is the one place the
    aggregation denominators are computed (the controller, every train backend and the tests).
    """
    import torch

    parts = [batches] if isinstance(batches, Batch) else list(batches)
    tokens = 0.0
    sequences = 0.0
    longest = 0.0
    for part in parts:
        if len(part) == 0:
            continue
        if "loss_mask" not in part:
            raise KeyError("compute_norm: the batch has no 'loss_mask' tensor")
        mask = part["loss_mask"]
        if mask.dim() != 2:
            raise ValueError(f"compute_norm: 'loss_mask' must be 2-D [B, T], got shape {tuple(mask.shape)}")
        per_row = (mask != 0).to(torch.float64).sum(dim=1)
        tokens += float(per_row.sum())
        sequences += float((per_row > 0).sum())
        longest = max(longest, float(per_row.max()))
    if world:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = _collective_device()
            sums = torch.tensor([tokens, sequences], dtype=torch.float64, device=device)
            peak = torch.tensor([longest], dtype=torch.float64, device=device)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            tokens, sequences = (float(x) for x in sums.cpu())
            longest = float(peak.cpu()[0])
    return AggregationNorm(num_tokens=max(tokens, 1.0), num_sequences=max(sequences, 1.0),
                           max_response_length=max(longest, 1.0))


def _collective_device() -> "str":
    """The device collectives of the current process group need (CUDA for NCCL, else CPU)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"
