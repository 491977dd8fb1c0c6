"""The ``auto`` weight transport: per engine, the best transport any active plugin has to it.

Every active ``WeightTransportSpec`` with an ``auto_rank`` is asked about each engine once, at its
first update, with a :class:`~loongsage_hookspecs.WeightTarget` (the engine's ``GET
/get_server_info``, the trainer's node, whether the trainer's weights are on a GPU and whether the
run is colocated); the highest rank wins and carries that engine's updates from then on. The
shipped ranks:

=========================================================  ===============  ====  =======
engine                                                     transport        rank  plugin
=========================================================  ===============  ====  =======
an engine object in the trainer's process                  ``inprocess``    100   torch
SGLang server, colocated run, trainer on a GPU              ``sglang_tensor`` 90  sglang
embedded engine on this node (same ``node_id``), CPU       ``shm``          80    torch
SGLang server, trainer on a GPU                             ``sglang_nccl``  60    sglang
embedded engine with a ``broadcast`` receiver               ``broadcast``    50    torch
SGLang server, trainer without a GPU                        ``sglang_disk``  10    sglang
=========================================================  ===============  ====  =======

So the embedded engine gets shared memory on one node and a torch.distributed broadcast across
nodes or onto an accelerator (NCCL; zero-copy CUDA IPC is not implemented for it); an SGLang
server gets CUDA IPC handles on the trainer's own GPU, NCCL to other GPUs, and safetensors on a
shared disk when the trainer has no GPU (SGLang loads onto its GPU; a CPU trainer has no NCCL).
The choice is logged once per engine and counted per update in ``perf/weight_targets_<name>``.
Nodes are told apart by :func:`loongsage_core.backend_api.node_id` (Ray's node id in a Ray
cluster, never the IP). An engine no transport ranks is an error that names it and what it
reported. The trainer's device and colocation come from the job (``[placement] trainer_gpus``,
``colocate``; without a job, this process's device). The candidates come from the context's
plugin registry, so a plugin's own transport joins by declaring ``auto_rank``.

``weight_transport_args`` hold one table per transport, given to that transport's sender when an
engine first needs it: ``weight_transport_args = { shm = { num_buffers = 4 }, broadcast = {
backend = "gloo" } }``. A key that names no candidate transport is an error listing them. When
engines take different transports, the weights are listed once (references to the trainer's
tensors) so every transport reads the same tensors.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Mapping

import torch

from loongsage_core.backend_api.distributed import node_id
from loongsage_core.backend_api.serving import engine_headers
from loongsage_hookspecs import ComponentRef, LoraSettings, WeightTarget, WeightTransportContext

from .shm import WeightTransferError

log = logging.getLogger(__name__)


def choose_transport(target: WeightTarget, candidates: Mapping[str, Any]) -> str:
    """The name of the candidate transport that ranks ``target`` highest (ties: the first name in
    alphabetical order); :class:`WeightTransferError` naming the engine when none reaches it."""
    ranks = {name: spec.auto_rank(target) for name, spec in sorted(candidates.items())}
    reachable = {name: rank for name, rank in ranks.items() if rank is not None}
    if not reachable:
        shown = {k: target.server_info[k] for k in ("engine", "version", "node_id", "device", "weight_load_formats")
                 if k in target.server_info}
        raise WeightTransferError(
            f"auto weight transport: no active transport reaches engine {target.url or '(in-process object)'} "
            f"(it reports {shown or 'nothing auto can use'}; candidates: {', '.join(sorted(candidates)) or 'none'}); "
            "enable the plugin of its transport (sglang for SGLang servers) or choose one explicitly")
    return max(reachable, key=lambda name: reachable[name])


class AutoSender:
    """Trainer side of ``auto`` (a ``WeightSender``): routes each target to its best transport."""

    def __init__(self, candidates: Mapping[str, Any], args: Mapping[str, Any] | None = None, *,
                 ctx: WeightTransportContext | None = None, trainer_on_gpu: bool = False,
                 colocated: bool = False, timeout_s: float = 30.0) -> None:
        self.candidates = dict(candidates)
        self.args = check_args(dict(args or {}), self.candidates)
        self.ctx = ctx or WeightTransportContext(role="sender")
        self.trainer_on_gpu, self.colocated = bool(trainer_on_gpu), bool(colocated)
        self.timeout_s = float(timeout_s)
        self.node_id = node_id()
        self.routes: dict[str, str] = {}
        self._senders: dict[str, Any] = {}
        self._lora: LoraSettings | None = None

    @classmethod
    def from_context(cls, ctx: WeightTransportContext, **args: Any) -> "AutoSender":
        """The sender a run builds: the registry's ranking transports, the job's placement."""
        registry = ctx.components
        if registry is None:
            raise ValueError("auto weight transport: its context has no plugin registry (components), which "
                             "holds the transports it chooses among")
        candidates = {name: spec for name, spec in registry.components("weight_transport").items()
                      if spec.auto_rank is not None}
        placement = getattr(ctx.job, "placement", None)
        on_gpu = float(placement.trainer_gpus) > 0 if placement is not None else torch.cuda.is_available()
        colocated = bool(placement.colocate) if placement is not None else False
        return cls(candidates, args, ctx=ctx, trainer_on_gpu=on_gpu, colocated=colocated)

    def configure_lora(self, settings: LoraSettings) -> None:
        """Remember a LoRA run's adapter settings for the transports built later that need them."""
        self._lora = settings
        for sender in self._senders.values():
            if callable(getattr(sender, "configure_lora", None)):
                sender.configure_lora(settings)

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

    def target(self, engine: Any) -> WeightTarget:
        """What the transports are asked about ``engine`` (an engine URL or an engine object)."""
        common = {"trainer_node": self.node_id, "trainer_on_gpu": self.trainer_on_gpu, "colocated": self.colocated}
        if not isinstance(engine, str):
            if callable(getattr(engine, "load_weights", None)):
                return WeightTarget(url=None, in_process=True, **common)
            raise TypeError(f"auto weight transport: a target must be an engine URL or an engine object with "
                            f"load_weights(weights, version), got {engine!r}")
        url = engine.rstrip("/")
        return WeightTarget(url=url, server_info=self._server_info(url), **common)

    def route(self, engine: Any) -> str:
        """The name of the transport that carries ``engine``'s updates (decided at its first)."""
        if not isinstance(engine, str):
            return choose_transport(self.target(engine), self.candidates)
        url = engine.rstrip("/")
        if url not in self.routes:
            target = self.target(url)
            name = self.routes[url] = choose_transport(target, self.candidates)
            log.info("auto weight transport: engine %s gets %s (engine node %s, trainer node %s, device %s)",
                     url, name, target.engine_node, self.node_id, target.server_info.get("device", "?"))
        return self.routes[url]

    def _sender(self, name: str) -> Any:
        if name not in self._senders:
            if self.ctx.components is None:
                raise WeightTransferError("auto weight transport: its context has no plugin registry "
                                          "(components) to build the chosen transport's sender with")
            where = self.ctx.where  # the job key of the auto transport: its table for `name` is beside it
            args_where = (f"{where}_args.{name}" if where.endswith("weight_transport")
                          else f"{where}: weight_transport_args.{name}")
            ref = ComponentRef("weight_transport", name, self.args.get(name, {}), where=where, args_where=args_where)
            sender = self.ctx.components.bind(ref, self.ctx, using="sender")
            if self._lora is not None and callable(getattr(sender, "configure_lora", None)):
                sender.configure_lora(self._lora)
            self._senders[name] = sender
        return self._senders[name]

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
        full_bytes = 0.0
        for path, group in by_path.items():
            stats = self._sender(path).send(iter(weights) if isinstance(weights, list) else weights, version, group)
            out[f"perf/weight_targets_{path}"] = float(len(group))
            for key in ("timing/weight_group_setup_s", "perf/weight_update_buckets"):
                if key in stats:
                    out[key] = out.get(key, 0.0) + float(stats[key])
            out["perf/weight_update_bytes"] = max(out.get("perf/weight_update_bytes", 0.0),
                                                  float(stats.get("perf/weight_update_bytes", 0.0)))
            if "perf/weight_sync_bytes" in stats:  # bytes moved (delta sync) add up; the ratio is of the sums
                out["perf/weight_sync_bytes"] = out.get("perf/weight_sync_bytes", 0.0) + float(
                    stats["perf/weight_sync_bytes"])
                full_bytes += float(stats.get("perf/weight_sync_full_bytes", stats["perf/weight_sync_bytes"]))
                for key in ("perf/weight_sync_full", "perf/weight_sync_fallbacks"):
                    if key in stats:
                        out[key] = max(out.get(key, 0.0), float(stats[key]))
        if "perf/weight_sync_bytes" in out:
            out["perf/weight_sync_full_bytes"] = full_bytes
            out["perf/weight_sync_delta_ratio"] = out["perf/weight_sync_bytes"] / full_bytes if full_bytes else 1.0
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


def check_args(args: dict[str, Any], candidates: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``weight_transport_args`` of ``auto``: one table per candidate transport, by its name."""
    unknown = sorted(set(args) - set(candidates))
    if unknown:
        raise ValueError(f"auto weight transport: unknown weight_transport_args {unknown}: it takes one table per "
                         f"transport it may choose ({', '.join(sorted(candidates))}), e.g. "
                         "{ shm = { num_buffers = 4 } }")
    for name, table in args.items():
        if not isinstance(table, Mapping):
            raise ValueError(f"auto weight transport: weight_transport_args.{name} must be a table of the "
                             f"'{name}' transport's arguments, got {type(table).__name__}")
    return {name: dict(table) for name, table in args.items()}
