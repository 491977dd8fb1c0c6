"""The ``broadcast`` weight transport: flat byte buckets over a torch.distributed group.

For engines in other processes, on other devices or other nodes. The group is set up once, on
the first :meth:`BroadcastSender.send`, with SGLang's handshake: the trainer is rank 0 and hosts
the rendezvous; every engine is asked concurrently to join with ``POST
/init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
backend}``. Later updates reuse the group.

Each update packs the weights into buckets of at most ``bucket_bytes`` (see :mod:`.buckets`;
a tensor larger than a bucket continues across buckets, so memory stays bounded). For each
bucket the metadata goes first: ``POST /update_weights_from_distributed`` with ``load_format =
"broadcast"`` and ``bucket`` (names, dtypes, shapes, byte offsets, piece ranges); then the
bucket's bytes go out as one ``uint8`` broadcast from rank 0; then the sender waits for every
engine's answer. One collective per bucket whatever the number or dtypes of the tensors in it,
and the bytes arrive bit-exact. Only the last bucket carries ``weight_version`` and
``flush_cache``, so engines switch version once, when the whole model is in.

``backend = "auto"`` picks NCCL when the weights live on CUDA and Gloo otherwise (CPU
clusters, and the tests). The receiver also accepts SGLang's own per-tensor form of the request
(``names``/``dtypes``/``shapes``, one broadcast per tensor), so the sglang plugin's
``sglang_nccl`` sender can feed an embedded engine too.

With ``delta = true`` each tensor travels as its change since the last sync (see :mod:`.delta`):
the bucket metadata carries a ``delta`` table, the broadcast carries the encoded bytes, and the
receiver rebuilds and verifies each tensor after the broadcast (so the collective never goes out
of step); a mismatch answers an error and the sender sends that version again in full. The
encoding runs on the CPU (tensors on an accelerator are copied to the host first).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Mapping

import torch

from loongsage_core.backend_api.distributed import (
    destroy_weight_update_group,
    host_rendezvous,
    init_weight_update_group,
    join_with_engines,
    reachable_address,
    resolve_backend,
)
from loongsage_core.backend_api.serving import engine_headers

from .buckets import (
    BucketAssembler,
    BucketPacker,
    decode_bucket,
    dtype_from_name,
    dtype_name,
    encode_bucket,
    tensor_bytes,
)
from .delta import (
    MISMATCH_MARK,
    DeltaDecoder,
    DeltaEncoder,
    DeltaMismatchError,
    Encoded,
    delta_infos,
    send_synced,
    sync_metrics,
)
from .shm import WeightTransferError

LOAD_FORMAT = "broadcast"
DEFAULT_GROUP = "loongsage_weights"


def _endpoint(target: Any) -> Any:
    """An engine base URL (also read from an engine object's ``base_url``), or a callable
    ``(path, body) -> answer`` standing for an engine reached some other way."""
    if isinstance(target, str):
        return target.rstrip("/")
    url = getattr(target, "base_url", None)
    if isinstance(url, str):
        return url.rstrip("/")
    if callable(target):
        return target
    raise TypeError(f"broadcast weight transport: a target must be an engine base URL, an engine with a "
                    f"base_url, or a callable (path, body) -> answer; got {target!r}")


class BroadcastSender:
    """Trainer side of ``broadcast`` (a ``WeightSender``).

    ``bucket_bytes``: bucket capacity (default 256 MiB); ``backend``: ``"auto"``, ``"gloo"`` or
    ``"nccl"``; ``device``: where buckets are staged before the broadcast (default: CUDA for
    NCCL, else CPU); ``master_address`` / ``master_port``: the rendezvous the trainer hosts (the
    address must be reachable from the engines, default this node's IP in Ray, else loopback;
    port 0: the port the OS assigns when the trainer starts listening); ``group_name``; ``init_timeout_s``:
    group set-up limit; ``timeout_s``: per-request HTTP limit. ``delta``: send each tensor's change
    since the last sync (:mod:`.delta`); ``full_every``: with ``delta``, send the whole model
    every this many versions (0: only on the first sync and after a mismatch).
    """

    def __init__(self, bucket_bytes: int = 256 << 20, backend: str = "auto", device: str | None = None,
                 master_address: str | None = None, master_port: int = 0, group_name: str = DEFAULT_GROUP,
                 init_timeout_s: float = 300.0, timeout_s: float = 600.0, delta: bool = False,
                 full_every: int = 100) -> None:
        if int(bucket_bytes) < 64:
            raise ValueError(f"broadcast weight transport: bucket_bytes must be >= 64, got {bucket_bytes}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"broadcast weight transport: backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        self.bucket_bytes = int(bucket_bytes)
        self.delta = DeltaEncoder(full_every, LOAD_FORMAT) if delta else None
        self.backend = resolve_backend(backend, device)
        self.device = torch.device(device or ("cuda" if self.backend == "nccl" else "cpu"))
        self.master_address = master_address or reachable_address()
        self.master_port = int(master_port)
        self.group_name = group_name
        self.init_timeout_s = float(init_timeout_s)
        self.timeout_s = float(timeout_s)
        self.group: Any = None
        self.urls: list[Any] | None = None
        self._client: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._staging: list[torch.Tensor | None] = [None, None]
        self._lane: ThreadPoolExecutor | None = None

    # -- HTTP ------------------------------------------------------------------------------------
    def _post(self, url: Any, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        import httpx

        if callable(url):
            answer = url(path, body)
            if isinstance(answer, dict) and answer.get("success") is False:
                raise WeightTransferError(f"broadcast weight transport: engine {url!r} rejected {path}: "
                                          f"{answer.get('message', answer)}")
            return answer if isinstance(answer, dict) else {}
        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s, trust_env=False, headers=engine_headers())
        try:
            response = self._client.post(url + path, json=body, timeout=timeout or self.timeout_s)
        except httpx.HTTPError as exc:
            raise WeightTransferError(f"broadcast weight transport: POST {url}{path} failed: {exc}") from exc
        try:
            answer = response.json()
        except ValueError:
            answer = {"message": response.text}
        if response.status_code != 200 or (isinstance(answer, dict) and answer.get("success") is False):
            message = answer.get("error", answer) if isinstance(answer, dict) else answer
            raise WeightTransferError(f"broadcast weight transport: engine {url} answered {response.status_code} "
                                      f"to {path}: {str(message)[:500]}")
        return answer if isinstance(answer, dict) else {}

    # -- set-up ----------------------------------------------------------------------------------
    def _setup(self, urls: list[Any]) -> float:
        start = time.perf_counter()
        # the store listens before any engine hears of it: port 0 is the port the OS assigns here
        self._rendezvous = host_rendezvous(self.master_address, self.master_port,
                                           timeout_s=self.init_timeout_s)
        self.master_address, self.master_port = self._rendezvous.address, self._rendezvous.port
        world_size = 1 + len(urls)
        self._pool = ThreadPoolExecutor(max_workers=len(urls) + 1, thread_name_prefix="weights-broadcast")
        joins = [functools.partial(self._post, url, "/init_weights_update_group",
                                   {"master_address": self.master_address, "master_port": self.master_port,
                                    "rank_offset": 1 + i, "world_size": world_size, "group_name": self.group_name,
                                    "backend": self.backend}, self.init_timeout_s + 30)
                 for i, url in enumerate(urls)]
        self.group = join_with_engines(self._pool, joins, self._rendezvous, world_size,
                                       group_name=self.group_name, backend=self.backend,
                                       timeout_s=self.init_timeout_s, where="broadcast weight transport")
        self.urls = urls
        return time.perf_counter() - start

    # -- sending ---------------------------------------------------------------------------------
    def _staging_buffer(self, slot: int, size: int) -> torch.Tensor:
        """Staging buffer ``slot`` (of two: one is packed while the other is broadcast)."""
        buffer = self._staging[slot]
        if buffer is None or buffer.numel() < size:
            buffer = self._staging[slot] = torch.empty(max(size, self.bucket_bytes), dtype=torch.uint8,
                                                       device=self.device)
        return buffer

    def _broadcast(self, urls: list[Any], packer: BucketPacker, index: int, version: int, last: bool,
                   record: dict[str, Encoded] | None = None) -> int:
        import torch.distributed as dist

        assert self._pool is not None
        extra = {} if record is None else {"delta": delta_infos(record, (e.meta.name for e in packer.buckets[index]))}
        body = {"load_format": LOAD_FORMAT, "group_name": self.group_name,
                "bucket": encode_bucket(packer, index, version=version, last=last, **extra),
                "names": [e.meta.name for e in packer.buckets[index]],
                "weight_version": str(version) if last else None, "flush_cache": last}
        answers: list[Future[dict[str, Any]]] = [self._pool.submit(self._post, u, "/update_weights_from_distributed",
                                                                   body) for u in urls]
        size = packer.sizes[index]
        if size:
            dist.broadcast(self._staging_buffer(index % 2, size)[:size], src=0, group=self.group)
        for fut in answers:
            fut.result()
        return size

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: int, targets: list[Any]) -> dict[str, float]:
        """Broadcast ``weights`` to every target as weight version ``version``; returns timing metrics."""
        urls = [_endpoint(t) for t in targets]
        if not urls:
            return {}
        setup_s = 0.0
        if self.group is None:
            setup_s = self._setup(urls)
        elif urls != self.urls:
            raise ValueError(f"broadcast weight transport: the group was set up for engines {self.urls}, now asked "
                             f"to send to {urls}; build a new sender for other engines")
        if self.delta is None:
            metrics = self._send_once(weights, version, urls, None)
            total = int(metrics["perf/weight_update_bytes"])
            metrics = {**metrics, **sync_metrics(total, total)}
        else:
            metrics = send_synced(self.delta, weights,
                                  lambda stream, record: self._send_once(stream, version, urls, record),
                                  lambda exc: MISMATCH_MARK in str(exc))
        metrics["timing/weight_group_setup_s"] = setup_s
        return metrics

    def _send_once(self, weights: Iterable[tuple[str, torch.Tensor]], version: int, urls: list[Any],
                   record: dict[str, Encoded] | None) -> dict[str, float]:
        start = time.perf_counter()
        packer = BucketPacker(self.bucket_bytes, split_large=True)
        if self._lane is None:  # one thread sends the buckets in order while this one packs the next
            self._lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-broadcast-lane")
        sending: dict[int, Future[int]] = {}
        open_bucket = -1
        total = 0
        try:
            for name, tensor in weights:
                src = tensor_bytes(tensor)
                if src.device != self.device:
                    src = src.to(self.device)
                total += src.numel()
                for piece in packer.place(name, tuple(tensor.shape), dtype_name(tensor.dtype), src.numel()):
                    if piece.bucket != open_bucket:
                        if open_bucket >= 0:
                            sending[open_bucket % 2] = self._lane.submit(self._broadcast, urls, packer, open_bucket,
                                                                         version, False, record)
                        open_bucket = piece.bucket
                        if open_bucket % 2 in sending:  # its buffer is free once that bucket went out
                            sending.pop(open_bucket % 2).result()
                    buffer = self._staging_buffer(piece.bucket % 2, piece.offset + piece.nbytes)
                    if piece.nbytes:
                        buffer[piece.offset:piece.offset + piece.nbytes].copy_(
                            src[piece.start:piece.start + piece.nbytes])
            open_bucket = max(open_bucket, 0)
            sending[open_bucket % 2] = self._lane.submit(self._broadcast, urls, packer, open_bucket, version, True,
                                                         record)
        finally:
            for fut in sending.values():
                fut.result()
        seconds = time.perf_counter() - start
        return {"perf/weight_update_bytes": float(total), "perf/weight_update_buckets": float(open_bucket + 1),
                "timing/weight_update_s": seconds,
                "perf/weight_update_gb_per_s": total / max(seconds, 1e-9) / 1e9}

    def close(self) -> None:
        """Ask the engines to leave the group, then leave it (idempotent)."""
        if self.group is not None:
            for url in self.urls or []:
                try:
                    self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name}, 30.0)
                except Exception:  # noqa: BLE001 - the engine may already be gone at shutdown
                    pass
            destroy_weight_update_group(self.group)
            self.group = None
        if self._client is not None:
            self._client.close()
            self._client = None
        for pool in (self._pool, self._lane):
            if pool is not None:
                pool.shutdown(wait=False)
        self._pool = self._lane = None
        self._staging = [None, None]

    def __enter__(self) -> "BroadcastSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BroadcastReceiver:
    """Engine side (a ``WeightReceiver``): the groups this engine joined and what arrives over them.

    :meth:`join` / :meth:`leave` serve ``/init_weights_update_group`` and
    ``/destroy_weights_update_group``; :meth:`receive` serves ``/update_weights_from_distributed``
    in either form (a ``broadcast`` bucket, or SGLang's per-tensor lists). Received buckets land in
    one staging buffer per group; yielded tensors are views into it, valid until the next request
    of that group, so the engine copies them (``load_weights`` does) before answering. Requests of
    one group are served one at a time.
    """

    def __init__(self, **sender_args: Any) -> None:  # one weight_transport_args table serves both sides
        self._groups: dict[str, Any] = {}
        self._devices: dict[str, torch.device] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._assemblers: dict[str, BucketAssembler] = {}
        self._deltas: dict[str, DeltaDecoder] = {}
        self._locks: dict[str, threading.Lock] = {}

    @property
    def groups(self) -> list[str]:
        return sorted(self._groups)

    def join(self, master_address: str, master_port: int, rank_offset: int, world_size: int, *,
             group_name: str, backend: str = "nccl", timeout_s: float = 300.0) -> None:
        """Join the sender's group as rank ``rank_offset`` (blocks until every member has joined)."""
        if group_name in self._groups:
            raise ValueError(f"broadcast weight transport: this engine already joined group {group_name!r}; "
                             "destroy it first")
        backend = resolve_backend(backend)
        self._groups[group_name] = init_weight_update_group(master_address, master_port, rank_offset, world_size,
                                                            group_name=group_name, backend=backend,
                                                            timeout_s=timeout_s)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._devices[group_name] = device
        self._assemblers[group_name] = BucketAssembler(LOAD_FORMAT)
        self._deltas[group_name] = DeltaDecoder(LOAD_FORMAT)
        self._locks[group_name] = threading.Lock()

    def leave(self, group_name: str) -> bool:
        """Leave ``group_name``; False when this engine is not in it."""
        group = self._groups.pop(group_name, None)
        self._staging.pop(group_name, None)
        self._assemblers.pop(group_name, None)
        self._deltas.pop(group_name, None)
        self._devices.pop(group_name, None)
        self._locks.pop(group_name, None)
        if group is None:
            return False
        destroy_weight_update_group(group)
        return True

    def lock(self, group_name: str) -> threading.Lock:
        """The lock serializing one group's requests (hold it until the tensors are copied)."""
        self._require(group_name)
        return self._locks[group_name]

    def _require(self, group_name: str) -> Any:
        group = self._groups.get(group_name)
        if group is None:
            raise KeyError(f"broadcast weight transport: no weight update group {group_name!r} on this engine "
                           f"(joined: {self.groups}); call /init_weights_update_group first")
        return group

    def receive(self, payload: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive one request's tensors from the group it names (blocks on the broadcast)."""
        import torch.distributed as dist

        group_name = str(payload["group_name"])
        group = self._require(group_name)
        device = self._devices[group_name]
        if payload.get("load_format") == LOAD_FORMAT:
            decoded = decode_bucket(payload["bucket"] if not isinstance(payload["bucket"], dict)
                                    else json.dumps(payload["bucket"]))
            data = None
            if decoded.size:
                staging = self._staging.get(group_name)
                if staging is None or staging.numel() < decoded.size:
                    staging = self._staging[group_name] = torch.empty(decoded.size, dtype=torch.uint8, device=device)
                data = staging[:decoded.size]
                dist.broadcast(data, src=0, group=group)
            pairs = self._assemblers[group_name].tensors(decoded, data)
            if "delta" in decoded.fields:
                return self._rebuilt(group_name, pairs, decoded.fields["delta"])
            return pairs
        # SGLang's per-tensor form: one broadcast per tensor, in the listed order
        tensors = []
        for name, dtype, shape in zip(payload["names"], payload["dtypes"], payload["shapes"]):
            tensor = torch.empty(tuple(int(d) for d in shape), dtype=dtype_from_name(dtype), device=device)
            dist.broadcast(tensor, src=0, group=group)
            tensors.append((str(name), tensor))
        return iter(tensors)

    def _rebuilt(self, group_name: str, pairs: Iterator[tuple[str, torch.Tensor]],
                 infos: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """Delta-encoded tensors rebuilt and checked against this group's copy of the last bytes."""
        try:
            for name, tensor in self._deltas[group_name].decode(pairs, infos):
                yield name, tensor.to(self._devices[group_name])
        except DeltaMismatchError:
            self._assemblers[group_name].reset()
            raise

    def close(self) -> None:
        for name in list(self._groups):
            self.leave(name)
