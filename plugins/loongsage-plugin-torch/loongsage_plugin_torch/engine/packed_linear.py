"""Projection weights pre-packed for oneDNN's matrix product, for the engine's small products.

A decode step multiplies a few rows (one per running request) by every weight of the model. At
that shape torch's default CPU matrix product reads the weight in its plain layout and reaches
about half the machine's matmul rate; oneDNN with the weight reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile`` uses on x86 CPUs)
runs the same products about twice as fast (``benchmarks/engine_throughput.py``), and prefill's
large products no slower. The results equal the plain product to float rounding (checked when a
runner starts, see :func:`packing_works`).

The packed copy must follow the weights: :class:`PackedWeight` remembers the version counters of
the parameters it was packed from and packs again before the first product after any of them
changed in place (a weight update, a merged LoRA adapter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

BATCH_HINT = 32
"""The row count oneDNN chooses the packed layout for (it serves any count)."""


def packing_available(dtype: "torch.dtype") -> bool:
    """Whether this torch build packs CPU weights of ``dtype`` for oneDNN (x86 builds with
    oneDNN, float32 and bfloat16)."""
    import torch

    ops = getattr(torch.ops, "mkldnn", None)
    return (dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class PackedWeight:
    """``x @ weight.T + bias`` with ``weight`` (``[out, in]``, from ``weight_of()``) packed for
    oneDNN, packed again when a tensor in ``sources`` was changed in place since."""

    def __init__(self, weight_of: Callable[[], "torch.Tensor"], sources: Sequence["torch.Tensor"]) -> None:
        self.weight_of = weight_of
        self.sources = list(sources)
        self.version = -1
        self.packed: Any = None

    def _current(self) -> int:
        return sum(t._version for t in self.sources)

    def linear(self, x: "torch.Tensor", bias: "torch.Tensor | None") -> "torch.Tensor":
        import torch

        version = self._current()
        if version != self.version:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight_of().contiguous(), BATCH_HINT)
            self.version = version
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def packing_works(dtype: "torch.dtype", in_features: int, out_features: int) -> bool:
    """Whether a packed product equals the plain one on random inputs (a build whose oneDNN
    misbehaves, or lacks the kernels, then keeps the plain product)."""
    import torch

    if not packing_available(dtype):
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    try:
        for rows in (1, 7, BATCH_HINT + 3):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            got = PackedWeight(lambda: weight, [weight]).linear(x, bias)
            want = torch.nn.functional.linear(x, weight, bias)
            if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * 10):
                return False
    except RuntimeError:
        return False
    return True
