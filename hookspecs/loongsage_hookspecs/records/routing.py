"""The experts a mixture-of-experts rollout engine routed each token to (Router Replay, R3).

An MoE model's engine and trainer can pick different top-k experts for the same token (a few ulps
of difference flip a choice); the engine's choices, recorded with the tokens, let the trainer
route exactly as the engine did (``[algorithm] router_replay``). :class:`RoutedExperts` holds
them compactly: int16 expert ids in a flat ``array`` (no numpy or torch needed to carry them),
``width = layers * top_k`` ids per token in SGLang's ``[positions, layers, top_k]`` row-major
layout; -1 marks "no record" (a dense layer, or a token the engine never ran, such as the last
generated one).
"""

from __future__ import annotations

import array
import base64
import sys
from typing import TYPE_CHECKING, Any, Iterable

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import torch

NO_EXPERT = -1
"""The id standing for "no record" in :class:`RoutedExperts`."""


def _ids(values: Iterable[int] | array.array | None = None) -> array.array:
    if isinstance(values, array.array) and values.typecode == "h":
        return values
    return array.array("h", values if values is not None else ())


@attrs.define(eq=False)
class RoutedExperts:
    """Expert ids per token: ``ids[(t * layers + l) * top_k + j]`` is token ``t``'s ``j``-th expert
    in decoder layer ``l`` (``width = layers * top_k`` ids per token), -1 where none was recorded.

    ``width`` is all the record knows of the shape: the engine's answer gives the layers and top-k
    only together, and the trainer, which knows its model, splits them (:meth:`to_tensor`).
    """

    width: int
    ids: array.array = attrs.field(factory=lambda: array.array("h"), converter=_ids)

    def __attrs_post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"RoutedExperts.width must be >= 1, got {self.width}")
        if len(self.ids) % self.width:
            raise ValueError(f"RoutedExperts: {len(self.ids)} ids are not a whole number of tokens of "
                             f"{self.width} (layers * top_k) ids")

    def __len__(self) -> int:
        """The number of tokens recorded."""
        return len(self.ids) // self.width

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoutedExperts) and self.width == other.width and self.ids == other.ids

    @classmethod
    def from_sglang(cls, encoded: str, positions: int, dtype: str = "int32") -> "RoutedExperts":
        """Decode SGLang's ``meta_info.routed_experts``: base64 of a little-endian ``dtype`` array
        ``[positions, layers, top_k]`` (``positions`` = prompt + output tokens - 1, the tokens
        the engine ran). A payload that is not a whole number of ``positions`` rows, or ids out of
        int16's range, is a ``ValueError``."""
        codes = {"int32": "i", "int16": "h", "int64": "q"}
        if dtype not in codes:
            raise ValueError(f"routed_experts_dtype {dtype!r} is not one of {sorted(codes)}")
        try:
            raw = base64.b64decode(encoded, validate=True)
        except (ValueError, TypeError):
            raise ValueError("routed_experts is not valid base64") from None
        values = array.array(codes[dtype])
        if len(raw) % values.itemsize:
            raise ValueError(f"routed_experts has {len(raw)} bytes, not a whole number of {dtype} values")
        values.frombytes(raw)
        if sys.byteorder != "little":  # pragma: no cover - the wire format is little-endian
            values.byteswap()
        if positions < 1 or len(values) % positions or not values:
            raise ValueError(f"routed_experts has {len(values)} ids, not a whole number of rows for "
                             f"{positions} positions")
        if values.typecode == "h":
            return cls(len(values) // positions, values)
        if min(values) < NO_EXPERT or max(values) > 32767:
            raise ValueError("routed_experts holds expert ids outside [-1, 32767]")
        # narrowed without a Python loop (a long rollout holds millions of ids): every id fits in
        # int16, so it is the low half of its wider word; take those halves as one strided copy
        step = values.itemsize // 2
        halves = memoryview(values).cast("B").cast("h")
        ids = array.array("h")
        ids.frombytes(halves[(0 if sys.byteorder == "little" else step - 1)::step].tobytes())
        return cls(len(values) // positions, ids)

    def extend_unrecorded(self, tokens: int) -> None:
        """Append ``tokens`` tokens without a record (-1), in place."""
        self.ids.extend(array.array("h", [NO_EXPERT]) * (tokens * self.width))

    def padded(self, tokens: int) -> "RoutedExperts":
        """The first ``tokens`` tokens' records, -1 rows appended where this one is shorter."""
        have = min(len(self), tokens)
        ids = self.ids[: have * self.width]
        ids.extend(array.array("h", [NO_EXPERT]) * ((tokens - have) * self.width))
        return RoutedExperts(self.width, ids)

    def to_tensor(self, top_k: int | None = None) -> "torch.Tensor":
        """The ids as an int16 tensor ``[tokens, width]``, or ``[tokens, width // top_k, top_k]``."""
        import torch

        flat = torch.frombuffer(bytearray(self.ids.tobytes()), dtype=torch.int16) if self.ids else \
            torch.zeros(0, dtype=torch.int16)
        if top_k is None:
            return flat.view(len(self), self.width)
        if self.width % top_k:
            raise ValueError(f"routed experts have {self.width} ids per token, not a multiple of top_k={top_k}")
        return flat.view(len(self), self.width // top_k, top_k)

    def to_json(self) -> dict[str, Any]:
        """``{"width", "ids"}`` with the ids as base64 of little-endian int16 (records, admin API)."""
        ids = self.ids
        if sys.byteorder != "little":  # pragma: no cover
            ids = array.array("h", ids)
            ids.byteswap()
        return {"width": self.width, "ids": base64.b64encode(ids.tobytes()).decode("ascii")}

    @classmethod
    def from_json(cls, data: Any) -> "RoutedExperts":
        """Inverse of :meth:`to_json`."""
        if not isinstance(data, dict) or not isinstance(data.get("width"), int) or not isinstance(data.get("ids"), str):
            raise ValueError("routed_experts must be an object with an integer 'width' and base64 'ids'")
        ids = array.array("h")
        ids.frombytes(base64.b64decode(data["ids"], validate=True))
        if sys.byteorder != "little":  # pragma: no cover
            ids.byteswap()
        return cls(int(data["width"]), ids)
