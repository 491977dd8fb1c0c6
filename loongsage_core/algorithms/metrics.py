"""Exact mini-batch metrics from micro-batch contributions.

A loss pipeline reports two kinds of metric values per micro-batch:

* per-token tensors ``[B, T]`` (clip indicators, entropy, KL, ...): their mini-batch value is the
  masked token mean, so the accumulator keeps the masked sum and the mask count;
* 0-dim tensors or numbers (loss terms already divided by the global norm): each is a share of a
  mini-batch total, so the accumulator sums them;
* :class:`Maximum` values (``train/logprob_abs_diff_max``): the largest over micro-batches and ranks.

Across data-parallel ranks the sums and counts are all-reduced before dividing, so ``train/*``
values are the exact means of the whole mini-batch however it was split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch


class Maximum:
    """A metric value whose mini-batch value is the maximum over micro-batches and ranks."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class MetricAccumulator:
    """Accumulates masked sums/counts (means) and plain sums (totals) by metric name.

    ``prefix`` is prepended to every name in :meth:`result` (``"train/"`` by default).
    """

    def __init__(self, prefix: str = "train/") -> None:
        self.prefix = prefix
        self._sums: dict[str, Any] = {}
        self._counts: dict[str, Any] = {}
        self._totals: dict[str, Any] = {}
        self._maxima: dict[str, float] = {}

    # -- adding -----------------------------------------------------------------------------

    def add(self, metrics: Mapping[str, Any], mask: "torch.Tensor | None" = None) -> None:
        """Add one micro-batch's metrics: tensors with a shape are masked means over ``mask``
        (all ones when ``mask`` is None), 0-dim tensors and numbers are summed totals."""
        for name, value in metrics.items():
            if isinstance(value, Maximum):
                self.add_max(name, value.value)
            elif _is_per_token(value):
                self.add_mean(name, value, mask)
            else:
                self.add_total(name, value)

    def add_mean(self, name: str, values: "torch.Tensor", mask: "torch.Tensor | None" = None) -> None:
        """Add the masked sum and count of per-token ``values`` under ``name``."""
        import torch

        if name in self._totals:
            raise ValueError(f"metric {name!r} was reported both as a per-token value and as a total")
        v = values.detach().to(torch.float64)
        if mask is None:
            m = torch.ones_like(v)
        else:
            m = mask.detach().to(device=v.device, dtype=torch.float64)
            if m.shape != v.shape:
                raise ValueError(f"metric {name!r}: values of shape {tuple(v.shape)} do not match the mask "
                                 f"of shape {tuple(m.shape)}")
        self._sums[name] = self._sums.get(name, 0.0) + torch.where(m > 0, v * m, torch.zeros_like(v)).sum()
        self._counts[name] = self._counts.get(name, 0.0) + m.sum()

    def add_total(self, name: str, value: Any) -> None:
        """Add a scalar share of a mini-batch total under ``name``."""
        if name in self._sums:
            raise ValueError(f"metric {name!r} was reported both as a per-token value and as a total")
        if hasattr(value, "detach"):
            value = value.detach().double()
        self._totals[name] = self._totals.get(name, 0.0) + value

    def add_max(self, name: str, value: Any) -> None:
        """Keep the largest ``value`` seen under ``name``."""
        value = float(value.detach().max()) if hasattr(value, "detach") else float(value)
        self._maxima[name] = max(self._maxima.get(name, value), value)

    def add_scalar_mean(self, name: str, value: Any, weight: float) -> None:
        """Add a scalar that is already a mean over ``weight`` tokens (weighted across calls)."""
        if name in self._totals:
            raise ValueError(f"metric {name!r} was reported both as a per-token value and as a total")
        if hasattr(value, "detach"):
            value = value.detach().double()
        self._sums[name] = self._sums.get(name, 0.0) + value * weight
        self._counts[name] = self._counts.get(name, 0.0) + weight

    # -- reading ----------------------------------------------------------------------------

    def reduce(self) -> None:
        """Sum every accumulated value over the ranks of the ``torch.distributed`` group.

        A no-op without an initialised group of more than one rank. All ranks must call it;
        names only some ranks saw are included (counted as zero elsewhere).
        """
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        local = {"mean": sorted(self._sums), "total": sorted(self._totals), "max": sorted(self._maxima)}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        means = sorted({n for g in gathered for n in g["mean"]})
        totals = sorted({n for g in gathered for n in g["total"]})
        clash = set(means) & set(totals)
        if clash:
            raise ValueError(f"metrics {sorted(clash)} are per-token on some ranks and totals on others")
        values = [self._sums.get(n, 0.0) for n in means] + [self._counts.get(n, 0.0) for n in means]
        values += [self._totals.get(n, 0.0) for n in totals]
        from .norm import _collective_device

        packed = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        flat = packed.cpu().tolist()
        k = len(means)
        self._sums = dict(zip(means, flat[:k]))
        self._counts = dict(zip(means, flat[k:2 * k]))
        self._totals = dict(zip(totals, flat[2 * k:]))
        maxima = sorted({n for g in gathered for n in g["max"]})
        if maxima:
            peak = torch.tensor([self._maxima.get(n, float("-inf")) for n in maxima], dtype=torch.float64,
                                device=_collective_device())
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            self._maxima = dict(zip(maxima, peak.cpu().tolist()))

    def result(self) -> dict[str, float]:
        """``prefix + name -> value``: masked means (NaN-free: 0 when nothing was masked in) and totals."""
        out: dict[str, float] = {}
        for name, total in self._sums.items():
            count = float(self._counts[name])
            out[self.prefix + name] = float(total) / count if count > 0 else 0.0
        for name, total in self._totals.items():
            out[self.prefix + name] = float(total)
        for name, peak in self._maxima.items():
            out[self.prefix + name] = float(peak)
        return out


def _is_per_token(value: Any) -> bool:
    return hasattr(value, "dim") and value.dim() > 0
