"""The ``sglang_nccl`` weight transport: a broadcast group between the trainer and SGLang servers.

Set-up, once per sender (the first :meth:`NcclSender.send`): the trainer is rank 0 of a new
process group of ``1 + sum(ranks per engine)`` ranks; engine ``i``'s ranks start at
``rank_offset = 1 + i * tp_size``. Each engine is asked, concurrently, to join with
``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
group_name, backend}`` while the trainer joins the same rendezvous (a TCP store it hosts on
``master_port``).

Each update: the weights are cut into buckets of about ``bucket_bytes`` (a tensor larger than a
bucket gets a bucket of its own). For each bucket, every engine is first told what comes with
``POST /update_weights_from_distributed {names, dtypes, shapes, group_name, ...}`` (answered
once the engine has received and loaded the bucket), then the trainer broadcasts the bucket's
tensors from rank 0 in exactly that order, then it waits for the answers. Only the last bucket
carries ``weight_version`` and ``flush_cache``, so the engines switch version once, when the
whole model is in.

Needs CUDA and NCCL on both sides for ``backend = "nccl"``; ``backend = "gloo"`` moves CPU tensors
(what the CPU tests use against a stand-in server).
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from loongsage_core.backend_api.distributed import (
    destroy_weight_update_group,
    host_rendezvous,
    join_with_engines,
    reachable_address,
)

from .client import SGLangClient, update_weights_from_distributed_body
from .targets import target_url
from .transport_lora import LoraSwitch

if TYPE_CHECKING:  # pragma: no cover
    import torch


def dtype_name(dtype: "torch.dtype") -> str:
    """SGLang's dtype string for a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def iter_buckets(weights: Iterable[tuple[str, "torch.Tensor"]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """Group ``weights`` in order into consecutive buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` forms a bucket of its own; no bucket is empty; the
    concatenation of the buckets is ``weights`` in the original order.
    """
    if int(bucket_bytes) < 1:
        raise ValueError(f"sglang_nccl weight transport: bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def bucket_metadata(bucket: list[tuple[str, "torch.Tensor"]]) -> tuple[list[str], list[str], list[list[int]]]:
    """``(names, dtypes, shapes)`` of a bucket, in broadcast order (SGLang's field layout)."""
    return ([n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket], [list(t.shape) for _, t in bucket])


class NcclSender(LoraSwitch):
    """Trainer side of ``sglang_nccl`` (a ``WeightSender``).

    ``bucket_bytes``: bucket size (default 512 MiB); ``tp_size``: ranks of each SGLang server (its
    ``--tp-size``); ``master_address`` / ``master_port``: where the trainer hosts the rendezvous
    (reachable from the engines, default this node's IP in Ray, else loopback; port 0: the port
    the OS assigns when the trainer starts listening, before any engine is told it);
    ``group_name`` / ``backend``: the group; ``device``: where tensors are broadcast from (default
    ``"cuda"`` for NCCL, ``"cpu"`` otherwise);
    ``init_timeout_s``: group set-up limit; ``timeout_s``: per-request HTTP timeout.
    """

    def __init__(self, bucket_bytes: int = 512 << 20, tp_size: int = 1, master_address: str | None = None,
                 master_port: int = 0, group_name: str = "loongsage_weight_sync", backend: str = "nccl",
                 device: str | None = None, init_timeout_s: float = 600.0, timeout_s: float | None = None,
                 abort_all_requests: bool = False, delta: bool = False) -> None:
        if delta:
            raise ValueError("sglang_nccl weight transport: weight_transport_args.delta = true is not supported: an "
                             "SGLang server receives whole tensors over NCCL and cannot rebuild a delta; delta sync "
                             "is offered by the torch plugin's shm and broadcast transports")
        if int(bucket_bytes) < 1:
            raise ValueError(f"sglang_nccl weight transport: bucket_bytes must be positive, got {bucket_bytes}")
        if int(tp_size) < 1:
            raise ValueError(f"sglang_nccl weight transport: tp_size must be >= 1, got {tp_size}")
        self.bucket_bytes = int(bucket_bytes)
        self.tp_size = int(tp_size)
        self.master_address = master_address or reachable_address()
        self.master_port = int(master_port)
        self.group_name = group_name
        self.backend = backend
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        self.init_timeout_s = float(init_timeout_s)
        self.timeout_s = timeout_s
        self.abort_all_requests = bool(abort_all_requests)
        self.group: Any = None
        self.urls: list[str] | None = None
        self._clients: dict[str, SGLangClient] = {}
        self._pool: ThreadPoolExecutor | None = None

    # -- set-up --------------------------------------------------------------------------------
    def group_layout(self, n_engines: int) -> tuple[int, list[int]]:
        """``(world_size, rank_offsets)`` for ``n_engines`` engines behind the trainer's rank 0."""
        return 1 + n_engines * self.tp_size, [1 + i * self.tp_size for i in range(n_engines)]

    def init_requests(self, urls: list[str]) -> list[dict[str, Any]]:
        """The ``/init_weights_update_group`` body for each engine of ``urls``."""
        from .client import init_weights_update_group_body

        world_size, offsets = self.group_layout(len(urls))
        return [init_weights_update_group_body(self.master_address, self.master_port, off, world_size,
                                               group_name=self.group_name, backend=self.backend)
                for off in offsets]

    def _client(self, url: str) -> SGLangClient:
        if url not in self._clients:
            self._clients[url] = SGLangClient(url, timeout=self.timeout_s)
        return self._clients[url]

    def _setup(self, urls: list[str]) -> float:
        start = time.perf_counter()
        # the store listens before any engine hears of it: port 0 is the port the OS assigns here
        self._rendezvous = host_rendezvous(self.master_address, self.master_port,
                                           timeout_s=self.init_timeout_s)
        self.master_address, self.master_port = self._rendezvous.address, self._rendezvous.port
        self._pool = ThreadPoolExecutor(max_workers=len(urls) + 1, thread_name_prefix="sglang-nccl")
        bodies = self.init_requests(urls)
        joins = [functools.partial(self._client(u).request, "POST", "/init_weights_update_group", body,
                                   timeout=self.init_timeout_s) for u, body in zip(urls, bodies)]
        self.group = join_with_engines(self._pool, joins, self._rendezvous,
                                       bodies[0]["world_size"], group_name=self.group_name, backend=self.backend,
                                       timeout_s=self.init_timeout_s, where="sglang_nccl weight transport")
        self.urls = urls
        return time.perf_counter() - start

    # -- sending -------------------------------------------------------------------------------
    def send(self, weights: Iterable[tuple[str, "torch.Tensor"]], version: int, targets: list[Any]) -> dict[str, float]:
        """Broadcast ``weights`` to every target as weight version ``version``; returns timing metrics."""
        if self._lora is not None:  # a LoRA run: the adapter goes through SGLang's adapter endpoints
            return self._send_adapter(weights, version, targets, "sglang_nccl")
        import torch.distributed as dist

        urls = [target_url(t, "sglang_nccl") for t in targets]
        if not urls:
            return {}
        setup_s = 0.0
        if self.group is None:
            setup_s = self._setup(urls)
        elif urls != self.urls:
            raise ValueError(f"sglang_nccl weight transport: the group was set up for engines {self.urls}, "
                             f"now asked to send to {urls}; build a new sender for other engines")
        assert self._pool is not None
        start = time.perf_counter()
        total = 0
        n_buckets = 0
        buckets = iter_buckets(weights, self.bucket_bytes)
        bucket = next(buckets, None)
        while bucket is not None:
            following = next(buckets, None)
            last = following is None
            on_device = [(n, t.detach().to(self.device).contiguous()) for n, t in bucket]
            names, dtypes, shapes = bucket_metadata(on_device)
            body = update_weights_from_distributed_body(
                names, dtypes, shapes, group_name=self.group_name, weight_version=version if last else None,
                flush_cache=last, abort_all_requests=self.abort_all_requests and n_buckets == 0)
            answers: list[Future[Any]] = [self._pool.submit(self._client(u).request, "POST",
                                                            "/update_weights_from_distributed", body, timeout=None)
                                          for u in urls]
            for _, tensor in on_device:  # same order as ``names``: the engines receive in that order
                dist.broadcast(tensor, src=0, group=self.group)
                total += tensor.numel() * tensor.element_size()
            for fut in answers:
                fut.result()
            n_buckets += 1
            bucket = following
        seconds = time.perf_counter() - start
        return {"perf/weight_update_bytes": float(total), "perf/weight_update_buckets": float(n_buckets),
                "timing/weight_update_s": seconds, "timing/weight_group_setup_s": setup_s,
                "perf/weight_update_gb_per_s": total / max(seconds, 1e-9) / 1e9}

    def close(self) -> None:
        """Ask the engines to leave the group, then destroy the trainer's side (idempotent)."""
        self._close_adapter()
        if self.group is not None:
            for url in self.urls or []:
                try:
                    self._client(url).destroy_weights_update_group(self.group_name)
                except Exception:  # noqa: BLE001 - the engine may already be gone at shutdown
                    pass
            destroy_weight_update_group(self.group)
            self.group = None
        for client in self._clients.values():
            client.close()
        self._clients = {}
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
