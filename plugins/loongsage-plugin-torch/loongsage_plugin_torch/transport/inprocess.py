"""The ``inprocess`` weight transport: engines in the trainer's own process load tensors directly."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch


class InProcessSender:
    """Hands the trainer's tensors to each target's ``load_weights(named_tensors, version)``.

    No bytes are copied by the transport: a target receives the same tensor objects (it copies
    them into its parameters). The tensors are listed once so several targets can read them.
    ``delta = true`` is refused: no bytes move, so there is nothing to shrink.
    """

    def __init__(self, delta: bool = False) -> None:
        if delta:
            raise ValueError("inprocess weight transport: weight_transport_args.delta = true is not supported: "
                             "engines in the trainer's process read its tensors and no bytes move; delta sync is "
                             "offered by the shm and broadcast transports")

    def send(self, weights: Iterable[tuple[str, "torch.Tensor"]], version: int,
             targets: list[Any]) -> dict[str, float]:
        start = time.perf_counter()
        named = list(weights)
        for target in targets:
            load = getattr(target, "load_weights", None)
            if load is None:
                raise TypeError(f"inprocess weight transport: target {target!r} has no load_weights(weights, version)")
            load(iter(named), version)
        seconds = time.perf_counter() - start
        nbytes = float(sum(t.numel() * t.element_size() for _, t in named))
        return {"perf/weight_update_bytes": nbytes, "timing/weight_update_s": seconds,
                "perf/weight_update_gb_per_s": nbytes * len(targets) / max(seconds, 1e-9) / 1e9}

    def close(self) -> None:
        """Nothing to release."""


class InProcessReceiver:
    """Yields the ``named_tensors`` of an in-process payload (``{"named_tensors": [(name, tensor), ...]}``)."""

    def receive(self, payload: Mapping[str, Any]) -> Iterator[tuple[str, "torch.Tensor"]]:
        if "named_tensors" not in payload:
            raise KeyError("inprocess weight transport: the payload has no 'named_tensors'")
        yield from payload["named_tensors"]
