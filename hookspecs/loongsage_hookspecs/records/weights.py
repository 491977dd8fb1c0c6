"""Records of a weight update: the metadata of each bucket of tensors sent from the trainer to
the rollout engines (the payload, a flat byte buffer, travels by the weight transport)."""

from __future__ import annotations

import attrs


@attrs.define
class TensorMeta:
    """Where one tensor lies inside a weight bucket's flat byte buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@attrs.define
class WeightBucket:
    """Metadata of one bucket of a weight update; sent before the payload it describes."""

    version: int
    index: int
    tensors: list[TensorMeta] = attrs.field(factory=list)
    last: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
