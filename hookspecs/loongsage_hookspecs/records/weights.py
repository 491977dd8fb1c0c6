"""Records of a weight update: the metadata of each bucket of tensors sent from the trainer to
the rollout engines (the payload, a flat byte buffer, travels by the weight transport), and the
engine a transport is chosen for (:class:`WeightTarget`)."""

from __future__ import annotations

from typing import Any, Mapping

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


@attrs.define(frozen=True, kw_only=True)
class WeightTarget:
    """One rollout engine as the ``auto`` weight transport sees it when it picks a path there.

    Each :class:`~loongsage_hookspecs.WeightTransportSpec` with an ``auto_rank`` is asked about
    every engine once, at its first weight update; the transport that ranks it highest carries
    its updates from then on.

    ``url``: the engine's base URL (``None`` for an engine object living in the trainer's process,
    ``in_process``). ``server_info``: its ``GET /get_server_info`` (empty for an in-process one):
    the embedded engine reports ``node_id``, ``device`` and ``weight_load_formats``, an SGLang
    server its server arguments (``model_path``, ``tp_size``, ...) and ``version``.
    ``trainer_node``: the trainer rank's node id (``loongsage_core.backend_api.node_id``: Ray's in
    a Ray cluster). ``trainer_on_gpu``: whether the trainer's weights live on a GPU
    (``[placement] trainer_gpus > 0``). ``colocated``: whether trainer and engines share devices
    (``[placement] colocate``; each engine then sits on its trainer rank's device).
    """

    url: str | None
    server_info: Mapping[str, Any] = attrs.field(factory=dict)
    trainer_node: str = ""
    trainer_on_gpu: bool = False
    colocated: bool = False
    in_process: bool = False

    @property
    def engine_node(self) -> str | None:
        """The engine's node id, when it reports one (the embedded engine does)."""
        node = self.server_info.get("node_id")
        return node if isinstance(node, str) else None

    @property
    def engine_on_gpu(self) -> bool:
        """Whether the engine reports its weights on an accelerator (a device other than ``cpu``)."""
        return not str(self.server_info.get("device", "cpu")).startswith("cpu")

    @property
    def load_formats(self) -> tuple[str, ...]:
        """The weight-update formats the engine says it receives (``weight_load_formats``)."""
        formats = self.server_info.get("weight_load_formats") or ()
        return tuple(str(f) for f in formats) if isinstance(formats, (list, tuple)) else ()
