"""Projection weights pre-packed for oneDNN's matrix product, where that is the faster product.

A decode step multiplies a few rows (one per running request) by every weight of the model.
oneDNN with the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile`` uses on x86 CPUs) is not
always the faster product at that shape. Measured decode steps of the embedded engine (1, 4 and
32 running requests; 2-core AVX-512/AMX machine, torch 2.13, one thread):

* bfloat16: packed products are 1.2-2.7x faster than ``torch.mm`` at every shape (oneDNN uses
  the AMX tiles): every bfloat16 model is packed.
* float32, models of at least :data:`FP32_PACK_MIN_PARAMETERS` parameters: the weights stream
  from memory at every step, and the blocked layout streams faster: a 135M-parameter model
  decodes 4 / 32 requests in 68 / 144 ms packed against 87 / 171 ms plain (a 27M one: 15 / 30
  against 17 / 30 ms). One row at a time ``torch.mm``'s matrix-vector path is faster
  (50 against 70 ms), so a one-row product uses the plain weight.
* float32, smaller models: their weights stay in the caches, and the packed call's fixed cost
  (about 15 us, more than a small product itself) dominates: a 4-layer, 128-wide model decodes
  4 requests in 1.1 ms plain against 1.8 ms packed. They are not packed.

On a 2-core AMD EPYC (AVX-512, no AMX) packing float32 pays as well (there one row is faster
packed too; a one-row product still uses the plain weight everywhere): the projections and output
layer of one decode step of the 135M shape take 49 / 41 / 112 ms packed against 53 / 74 / 156 ms
plain for 1 / 4 / 32 rows on one thread, and 30 / 29 / 67 against 52 / 73 / 108 ms on two; packing
the whole model again after a weight update takes 0.45 s on one thread and 0.15 s on two, paid
back within a few decode steps.

The results equal the plain product to float rounding (checked when a runner starts, see
:func:`packing_works`). The packed copy must follow the weights: :class:`PackedWeight` remembers
the version counters of the parameters it was packed from and packs again before the first
product after any of them changed in place (a weight update, a merged LoRA adapter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

BATCH_HINT = 32
"""The row count oneDNN chooses the packed layout for (it serves any count)."""

FP32_PACK_MIN_PARAMETERS = 16_000_000
"""The smallest float32 model (parameters, 64 MB) whose weights are worth packing."""


def worth_packing(dtype: "torch.dtype", num_parameters: int) -> bool:
    """Whether a model of this precision and size decodes faster with packed weights (see the
    module docstring): every bfloat16 model; float32 ones from :data:`FP32_PACK_MIN_PARAMETERS` on."""
    import torch

    return dtype != torch.float32 or num_parameters >= FP32_PACK_MIN_PARAMETERS


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

    def __init__(self, weight_of: Callable[[], "torch.Tensor"], sources: Sequence["torch.Tensor"], *,
                 plain_single_row: bool = False) -> None:
        """``weight_of()`` gives the ``[out, in]`` weight (a view is fine); ``sources``: the
        parameters it is made of; ``plain_single_row``: a one-row product uses the plain weight
        (float32, where ``torch.mm``'s matrix-vector path beats the packed one)."""
        self.weight_of = weight_of
        self.sources = list(sources)
        self.plain_single_row = plain_single_row
        self.version = -1
        self.packed: Any = None

    def _current(self) -> int:
        return sum(t._version for t in self.sources)

    def linear(self, x: "torch.Tensor", bias: "torch.Tensor | None") -> "torch.Tensor":
        import torch

        if self.plain_single_row and x.shape[0] == 1:
            return torch.nn.functional.linear(x, self.weight_of(), bias)
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
