"""Taking turns on shared devices in colocated runs (``placement.colocate`` with ``offload``).

A colocated step moves through three hand-overs (the order SGLang-based RL stacks use, so the
peak memory is one phase's, never both):

1. :meth:`PhaseSwitch.to_training`: after generation, every engine releases ``kv_cache`` and
   ``weights`` (``POST /release_memory_occupation``), then every trainer rank onloads;
2. :meth:`PhaseSwitch.to_weight_sync`: the engines take their ``weights`` memory back, so the new
   weights can be written into it (the trainer is still resident, it is the sender);
3. :meth:`PhaseSwitch.to_generation`: the trainer ranks offload, then the engines take the
   ``kv_cache`` (and anything else still released) back.

Engines are driven through their HTTP API, so the embedded engine and SGLang servers behave the
same; trainer ranks through their actors' ``offload``/``onload``. With ``offload = false`` or
separate pools every method does nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..config import JobConfig
from .remote import gather, waiting

TRAINING_TAGS = ("kv_cache", "weights")


class PhaseSwitch:
    """Hands the shared devices to the phase about to run; methods return ``timing/*`` metrics."""

    def __init__(self, job: JobConfig, trainers: list[Any], engine_clients: list[Any],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.enabled = bool(job.placement.colocate and job.placement.offload)
        self.trainers = trainers
        self.clients = engine_clients
        self.loop = loop
        self.released: set[str] = set()

    def _engines(self, action: str, tags: tuple[str, ...]) -> None:
        async def on_every_engine() -> None:
            await asyncio.gather(*(getattr(c, action)(list(tags)) for c in self.clients))

        with waiting():
            self.loop.run_until_complete(on_every_engine())

    def to_training(self) -> dict[str, float]:
        """Engines release their memory, then the trainer ranks onload."""
        if not self.enabled:
            return {}
        start = time.perf_counter()
        self._engines("release_memory_occupation", TRAINING_TAGS)
        self.released |= set(TRAINING_TAGS)
        gather([t.onload.remote() for t in self.trainers])
        return {"timing/to_training": time.perf_counter() - start,
                "perf/engine_memory_released": float(len(self.released))}

    def to_weight_sync(self) -> dict[str, float]:
        """Engines take their weight memory back before the new weights are written into it."""
        if not self.enabled or "weights" not in self.released:
            return {}
        start = time.perf_counter()
        self._engines("resume_memory_occupation", ("weights",))
        self.released.discard("weights")
        return {"timing/to_weight_sync": time.perf_counter() - start}

    def to_generation(self) -> dict[str, float]:
        """Trainer ranks offload, then the engines take back everything still released."""
        if not self.enabled:
            return {}
        start = time.perf_counter()
        gather([t.offload.remote() for t in self.trainers])
        if self.released:
            self._engines("resume_memory_occupation", tuple(sorted(self.released)))
            self.released.clear()
        return {"timing/to_generation": time.perf_counter() - start}
