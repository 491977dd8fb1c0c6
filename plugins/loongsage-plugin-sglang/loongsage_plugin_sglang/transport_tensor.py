"""The ``sglang_tensor`` weight transport: zero-copy tensor handles for engines on the same device.

For colocated runs, where the trainer and an SGLang server share a GPU (NCCL cannot join two
ranks on one device, and the disk is slow). The weights are packed, bucket by bucket, into a
staging buffer on the trainer's device; the bucket's tensors are views of that buffer, pickled
with ``torch.multiprocessing``'s reducers, so only *handles* travel: a CUDA IPC handle for a GPU
buffer, the name of a shared-memory file for a CPU buffer. This is SGLang's own
``update_weights_from_tensor`` format (``MultiprocessingSerializer``: a base64 pickle of a list
of ``(name, tensor)``, one entry per tensor-parallel rank, ``load_format`` unset). The engine
opens the handle, copies the tensors into its parameters and answers; only then is the buffer
reused (``num_buffers`` buffers rotate, so packing the next bucket overlaps the engine's copy).

A tensor larger than ``bucket_bytes`` gets a bucket of its own (the format cannot continue a
tensor in the next request). Only the last bucket carries ``weight_version`` and
``flush_cache``. CUDA handles name the sender's device index: both processes must see the
shared GPU under the same index (as Ray actors sharing one GPU bundle do). The torch plugin's
embedded engine accepts the same format on the CPU, which is how this transport is tested.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable

from .client import SGLangClient
from .targets import target_url
from .transport_lora import LoraSwitch
from .transport_nccl import iter_buckets

if TYPE_CHECKING:  # pragma: no cover
    import torch

ALIGN = 64
_strategy_lock = threading.Lock()
SHM_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
"""torch's ``torch_shm_manager`` answers a new shared-memory file within one second or the call
fails with this message; on a loaded machine (the daemon's first start, a busy CPU) it can be
slower, so sharing is retried a few times before the error stands."""
SHM_MANAGER_ATTEMPTS = 5


def serialize_named_tensors(named: list[tuple[str, "torch.Tensor"]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(named, output_str=True)``: handles, not bytes.

    CPU storages are shared by file name (``file_system`` strategy) for the duration of the call,
    so any process on this node can open them (the default ``file_descriptor`` strategy only
    reaches processes this one started). A timed-out ``torch_shm_manager`` is retried
    (:data:`SHM_MANAGER_TIMEOUT`).
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    with _strategy_lock:
        previous = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            for attempt in range(SHM_MANAGER_ATTEMPTS):
                buf = io.BytesIO()
                try:
                    ForkingPickler(buf).dump(named)
                    break
                except RuntimeError as exc:  # already-shared storages keep their file: a retry is safe
                    if SHM_MANAGER_TIMEOUT not in str(exc) or attempt + 1 == SHM_MANAGER_ATTEMPTS:
                        raise
                    time.sleep(0.2 * (attempt + 1))
        finally:
            mp.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class TensorHandleSender(LoraSwitch):
    """Trainer side of ``sglang_tensor`` (a ``WeightSender``).

    ``bucket_bytes``: staging bucket size (default 512 MiB); ``num_buffers``: staging buffers in
    rotation (default 2); ``tp_size``: ranks of each SGLang server (each gets its own copy of the
    handle list, as SGLang expects one entry per rank); ``timeout_s``: per-request HTTP timeout.
    """

    def __init__(self, bucket_bytes: int = 512 << 20, num_buffers: int = 2, tp_size: int = 1,
                 timeout_s: float | None = None, abort_all_requests: bool = False, delta: bool = False) -> None:
        if delta:
            raise ValueError("sglang_tensor weight transport: weight_transport_args.delta = true is not supported: an "
                             "SGLang server opens handles to the trainer's tensors and cannot rebuild a delta; "
                             "delta sync is offered by the torch plugin's shm and broadcast transports")
        if int(bucket_bytes) < ALIGN:
            raise ValueError(f"sglang_tensor weight transport: bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
        if int(num_buffers) < 1 or int(tp_size) < 1:
            raise ValueError(f"sglang_tensor weight transport: num_buffers and tp_size must be >= 1, got "
                             f"{num_buffers} and {tp_size}")
        self.bucket_bytes = int(bucket_bytes)
        self.num_buffers = int(num_buffers)
        self.tp_size = int(tp_size)
        self.timeout_s = timeout_s
        self.abort_all_requests = bool(abort_all_requests)
        self._buffers: list[Any] = [None] * self.num_buffers
        self._clients: dict[str, SGLangClient] = {}

    def _client(self, url: str) -> SGLangClient:
        if url not in self._clients:
            self._clients[url] = SGLangClient(url, timeout=self.timeout_s)
        return self._clients[url]

    def _buffer(self, slot: int, nbytes: int, device: "torch.device") -> "torch.Tensor":
        import torch

        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=device)
            if device.type == "cpu":
                buf.share_memory_()  # once: later buckets reuse the same shared file
            self._buffers[slot] = buf
        return buf

    def _pack(self, bucket: list[tuple[str, "torch.Tensor"]], slot: int) -> list[tuple[str, "torch.Tensor"]]:
        """Copy ``bucket`` into staging buffer ``slot``; the views, in order, with their names."""
        offsets, size = [], 0
        for _, tensor in bucket:
            offsets.append(size)
            size = (size + tensor.numel() * tensor.element_size() + ALIGN - 1) // ALIGN * ALIGN
        buf = self._buffer(slot, size, bucket[0][1].device)
        views = []
        for (name, tensor), offset in zip(bucket, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            view = buf[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            views.append((name, view))
        return views

    def send(self, weights: Iterable[tuple[str, "torch.Tensor"]], version: int, targets: list[Any]) -> dict[str, float]:
        """Hand ``weights`` to every target as weight version ``version``; returns timing metrics."""
        if self._lora is not None:  # a LoRA run: the adapter goes through SGLang's adapter endpoints
            return self._send_adapter(weights, version, targets, "sglang_tensor")
        urls = [target_url(t, "sglang_tensor") for t in targets]
        if not urls:
            return {}
        start = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=len(urls) * self.num_buffers, thread_name_prefix="sglang-tensor")
        in_flight: dict[int, list[Future[Any]]] = {}
        total = 0
        n_buckets = 0
        try:
            buckets = iter_buckets(weights, self.bucket_bytes)
            bucket = next(buckets, None)
            while bucket is not None:
                following = next(buckets, None)
                last = following is None
                slot = n_buckets % self.num_buffers
                # the engines are done with this buffer; before the last bucket (the one carrying the
                # version) with every buffer, so no earlier bucket lands after it and moves the version on
                for done in [slot] if not last else list(in_flight):
                    for fut in in_flight.pop(done, []):
                        fut.result()
                views = self._pack(bucket, slot)
                payload = [serialize_named_tensors(views)] * self.tp_size
                in_flight[slot] = [pool.submit(self._client(u).update_weights_from_tensor, payload,
                                               weight_version=version if last else None, flush_cache=last,
                                               abort_all_requests=self.abort_all_requests and n_buckets == 0)
                                   for u in urls]
                total += sum(t.numel() * t.element_size() for _, t in views)
                n_buckets += 1
                bucket = following
            for futures in in_flight.values():
                for fut in futures:
                    fut.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        seconds = time.perf_counter() - start
        return {"perf/weight_update_bytes": float(total), "perf/weight_update_buckets": float(n_buckets),
                "timing/weight_update_s": seconds,
                "perf/weight_update_gb_per_s": total * len(urls) / max(seconds, 1e-9) / 1e9}

    def close(self) -> None:
        """Drop the staging buffers (their shared memory goes once no engine maps it) and clients."""
        self._close_adapter()
        self._buffers = [None] * self.num_buffers
        for client in self._clients.values():
            client.close()
        self._clients = {}
