"""The ``auto`` weight transport: per engine, the fastest path this project has to it.

=====================================  ===========================================================
engine                                 path
=====================================  ===========================================================
an engine object in this process       ``inprocess``: its ``load_weights`` gets the tensors
same node (same ``node_id``), CPU      ``shm``: shared-memory buckets, no copy through a socket
other node, or weights on an           ``broadcast``: one torch.distributed group (NCCL on GPU,
accelerator                            Gloo on CPU), set up once and reused
=====================================  ===========================================================

An engine URL is asked once, at its first update, for ``GET /get_server_info`` (``node_id``,
``device``, ``weight_load_formats``); the choice is kept for the sender's life, logged once per
engine, and counted per update in the metrics ``perf/weight_targets_<path>`` (see
:func:`choose_path`). Nodes are told apart by :func:`loongsage_core.weight_group.node_id`: Ray's
node id in a Ray cluster, never the IP (two Ray nodes on one machine share an IP but not an object
store, and count as two nodes). Same-node CUDA engines take ``broadcast`` over NCCL: zero-copy
CUDA IPC handles are not implemented.
An engine that accepts neither ``shm`` nor ``broadcast`` (an SGLang server) is an error that
names it: use the sglang plugin's ``sglang_nccl`` or ``sglang_disk`` for those.

``weight_transport_args`` are split by name: ``bucket_bytes`` and ``timeout_s`` go to both
senders, ``num_buffers`` / ``split_large`` to ``shm``, ``backend`` / ``device`` /
``master_address`` / ``master_port`` / ``group_name`` / ``init_timeout_s`` to ``broadcast``.
When engines take different paths, the weights are listed once (references to the trainer's
tensors) so every path reads the same tensors.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

import torch

from loongsage_core.backend_api import engine_headers, node_id

from .broadcast import BroadcastSender
from .inprocess import InProcessSender
from .shm import ShmSender, WeightTransferError

log = logging.getLogger(__name__)

SHM_ARGS = ("num_buffers", "split_large")
BROADCAST_ARGS = ("backend", "device", "master_address", "master_port", "group_name", "init_timeout_s")


def choose_path(info: dict[str, Any], trainer_node: str, url: str) -> str:
    """``"shm"`` or ``"broadcast"`` for the engine at ``url`` whose ``/get_server_info`` is ``info``,
    seen from a trainer on node ``trainer_node``: shared memory only for a CPU engine on the same
    node that accepts it, a broadcast group otherwise (another node, or weights on an accelerator)."""
    formats = info.get("weight_load_formats") or []
    on_accelerator = not str(info.get("device", "cpu")).startswith("cpu")
    if "shm" in formats and info.get("node_id") == trainer_node and not on_accelerator:
        return "shm"
    if "broadcast" in formats:
        return "broadcast"
    raise WeightTransferError(
        f"auto weight transport: engine {url} accepts neither 'shm' nor 'broadcast' weight updates "
        f"(it reports {formats or 'no weight_load_formats'}); choose a transport for it explicitly, "
        "e.g. sglang_nccl or sglang_disk for SGLang servers")


class AutoSender:
    """Trainer side of ``auto`` (a ``WeightSender``): routes each target to its fastest path."""

    def __init__(self, bucket_bytes: int | None = None, timeout_s: float | None = None, copy: bool | None = None,
                 **args: Any) -> None:
        unknown = sorted(set(args) - set(SHM_ARGS) - set(BROADCAST_ARGS))
        if unknown:
            raise ValueError(f"auto weight transport: unknown weight_transport_args {unknown}; known: "
                             f"{sorted(('bucket_bytes', 'timeout_s', *SHM_ARGS, *BROADCAST_ARGS))}")
        common = {k: v for k, v in (("bucket_bytes", bucket_bytes), ("timeout_s", timeout_s)) if v is not None}
        self._shm_args = {**common, **{k: args[k] for k in SHM_ARGS if k in args}}
        self._broadcast_args = {**common, **{k: args[k] for k in BROADCAST_ARGS if k in args}}
        self.timeout_s = float(timeout_s or 30.0)
        self.node_id = node_id()
        self.routes: dict[str, str] = {}
        self._senders: dict[str, Any] = {}

    # -- routing ---------------------------------------------------------------------------------
    def _server_info(self, url: str) -> dict[str, Any]:
        import httpx

        try:
            response = httpx.get(url + "/get_server_info", timeout=self.timeout_s, trust_env=False,
                                 headers=engine_headers())
            response.raise_for_status()
            info = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise WeightTransferError(f"auto weight transport: cannot read {url}/get_server_info to pick a path "
                                      f"to that engine: {exc}") from exc
        return info if isinstance(info, dict) else {}

    def route(self, target: Any) -> str:
        """``"inprocess"``, ``"shm"`` or ``"broadcast"`` for ``target`` (an engine object or URL)."""
        if not isinstance(target, str):
            if callable(getattr(target, "load_weights", None)):
                return "inprocess"
            raise TypeError(f"auto weight transport: a target must be an engine URL or an engine object with "
                            f"load_weights(weights, version), got {target!r}")
        url = target.rstrip("/")
        if url not in self.routes:
            info = self._server_info(url)
            path = self.routes[url] = choose_path(info, self.node_id, url)
            log.info("auto weight transport: engine %s gets %s (engine node %s, trainer node %s, device %s)",
                     url, path, info.get("node_id"), self.node_id, info.get("device", "cpu"))
        return self.routes[url]

    def _sender(self, path: str) -> Any:
        if path not in self._senders:
            if path == "inprocess":
                self._senders[path] = InProcessSender()
            elif path == "shm":
                self._senders[path] = ShmSender(**self._shm_args)
            else:
                self._senders[path] = BroadcastSender(**self._broadcast_args)
        return self._senders[path]

    # -- sending ---------------------------------------------------------------------------------
    def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: int, targets: list[Any]) -> dict[str, float]:
        """Push ``weights`` to every target, each by its own path; metrics add up over the paths."""
        start = time.perf_counter()
        by_path: dict[str, list[Any]] = {}
        for target in targets:
            by_path.setdefault(self.route(target), []).append(target)
        if len(by_path) > 1:
            weights = list(weights)
        out: dict[str, float] = {}
        for path, group in by_path.items():
            stats = self._sender(path).send(iter(weights) if isinstance(weights, list) else weights, version, group)
            out[f"perf/weight_targets_{path}"] = float(len(group))
            for key in ("timing/weight_group_setup_s", "perf/weight_update_buckets"):
                if key in stats:
                    out[key] = out.get(key, 0.0) + float(stats[key])
            out["perf/weight_update_bytes"] = max(out.get("perf/weight_update_bytes", 0.0),
                                                  float(stats.get("perf/weight_update_bytes", 0.0)))
        seconds = time.perf_counter() - start
        out["timing/weight_update_s"] = seconds
        out["perf/weight_update_gb_per_s"] = out.get("perf/weight_update_bytes", 0.0) * len(targets) / max(
            seconds, 1e-9) / 1e9
        return out

    def close(self) -> None:
        """Close every sender this transport opened (idempotent)."""
        for sender in self._senders.values():
            sender.close()
        self._senders = {}
