"""Weight updates of the embedded engine: decoding the ``direct`` format and copying in place.

``direct`` is the engine's own ``load_format``: ``serialized_named_tensors`` is the base64 text
of ``torch.save`` of a list of ``(name, tensor)`` pairs (or a list of such texts, one per sender
rank, as SGLang sends one entry per tensor-parallel rank). Any other ``load_format`` names a
weight transport component whose receiver turns the request into ``(name, tensor)`` pairs.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch

DIRECT_FORMAT = "direct"


class WeightUpdateError(ValueError):
    """A weight update names an unknown parameter, has a wrong shape, or cannot be decoded."""


def decode_direct(payload: Mapping[str, Any]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """``(name, tensor)`` pairs of a ``direct``-format ``serialized_named_tensors`` field."""
    import torch

    raw = payload.get("serialized_named_tensors")
    parts = raw if isinstance(raw, list) else [raw]
    for i, part in enumerate(parts):
        if not isinstance(part, str):
            raise WeightUpdateError(
                f"'serialized_named_tensors' must be base64 text (or a list of them) for load_format "
                f"'{DIRECT_FORMAT}', got {type(part).__name__}")
        try:
            data = base64.b64decode(part, validate=True)
            obj = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:  # any decoding failure is a malformed request
            raise WeightUpdateError(f"'serialized_named_tensors'[{i}] cannot be decoded as base64 torch.save "
                                    f"data: {exc}") from None
        pairs = obj.items() if isinstance(obj, dict) else obj
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], torch.Tensor)):
                raise WeightUpdateError("'serialized_named_tensors' must hold (name, tensor) pairs")
            yield pair[0], pair[1]


def copy_named_tensors(targets: Mapping[str, "torch.Tensor"],
                       named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> int:
    """Copy each ``(name, tensor)`` into ``targets[name]`` in place; returns how many were copied.

    Tensors are checked and copied one at a time, so a transport may reuse its buffer between
    pairs; a bad name or shape stops the update with an error naming it.
    """
    import torch

    count = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise WeightUpdateError(f"weight update: unknown parameter name '{name}'")
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightUpdateError(f"weight update: '{name}' has shape {tuple(tensor.shape)}, "
                                        f"the model expects {tuple(target.shape)}")
            target.copy_(tensor)
            count += 1
    return count
