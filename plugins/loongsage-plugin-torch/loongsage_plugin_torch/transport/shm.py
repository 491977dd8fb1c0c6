"""The ``shm`` weight transport: shared-memory buckets on one node, announced over HTTP.

Sender (trainer process): tensors are packed into flat byte buckets (see :mod:`.buckets`), each
written into one of ``num_buffers`` ``multiprocessing.shared_memory`` blocks that are reused
across buckets and updates (a block grows only when a bucket does not fit). For each bucket the
sender POSTs to every engine ``{base_url}/update_weights_from_tensor``::

    {"load_format": "shm", "serialized_named_tensors": "<bucket metadata JSON>",
     "weight_version": <version>, "flush_cache": <true on the last bucket>}

and reuses a block only after every engine has answered for the bucket it held, so packing the
next bucket overlaps with the engines loading the previous one. Nothing is pickled.

Receiver (engine process): maps the named block (once; mappings are cached until the sender
retires the block) and yields ``(name, tensor)``; by default tensors are zero-copy views into the
block, valid until the engine answers the request, so the engine must copy them (as
``load_weights`` does). Byte views keep bfloat16 and every other dtype exact.

With ``delta = true`` each tensor travels as its change since the last sync (see :mod:`.delta`):
the bucket metadata gains a ``delta`` table (encoding and checksum per tensor) and the receiver
rebuilds and verifies each tensor before yielding it; a mismatch answers an error and the sender
sends that version again in full.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import shared_memory
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from loongsage_core.backend_api.serving import engine_headers

from .buckets import (
    BucketAssembler,
    BucketPacker,
    DecodedBucket,
    decode_bucket,
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

LOAD_FORMAT = "shm"
ENDPOINT = "/update_weights_from_tensor"


class WeightTransferError(RuntimeError):
    """An engine rejected or failed a weight bucket; the message names the engine and the bucket."""


BLOCK_PREFIX = "loongsage_w_"
"""Shared-memory blocks are named ``loongsage_w_<sender pid>_<random>``."""


def _block_name() -> str:
    import uuid

    return f"{BLOCK_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"


def reclaim_orphan_blocks(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the blocks of senders that no longer run (a run killed with SIGKILL cannot release
    them); returns their names. A block whose sender process still exists is left alone."""
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(BLOCK_PREFIX)]
    except OSError:  # no POSIX shared-memory directory to inspect here
        return []
    reclaimed = []
    for name in names:
        try:
            pid = int(name[len(BLOCK_PREFIX):].split("_", 1)[0])
            os.kill(pid, 0)
            continue  # its sender is alive
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue  # not ours to judge
        try:
            os.unlink(os.path.join(shm_dir, name))
            reclaimed.append(name)
        except OSError:
            pass
    return reclaimed


# ---------------------------------------------------------------------------------------------
# Sender
# ---------------------------------------------------------------------------------------------


def _release_blocks(blocks: list[Any]) -> None:
    """Close and unlink every block (also run by the sender's finalizer if ``close`` was missed)."""
    for i, block in enumerate(blocks):
        if block is None:
            continue
        blocks[i] = None
        try:
            block.close()
        except BufferError:  # a view is still alive; the unlink below still frees the name
            pass
        try:
            block.unlink()
        except FileNotFoundError:
            pass


class ShmSender:
    """Trainer side of the ``shm`` transport (``WeightSender``).

    ``bucket_bytes``: capacity of one bucket (default 64 MiB). ``split_large``: cut tensors larger
    than a bucket across buckets (default) instead of giving each its own larger bucket.
    ``num_buffers``: shared-memory blocks in rotation (2 lets packing overlap loading).
    ``timeout_s``: per-request HTTP timeout. ``delta``: send each tensor's change since the last
    sync (:mod:`.delta`); ``full_every``: with ``delta``, send the whole model every this many
    versions (0: only on the first sync and after a mismatch). ``copy`` is the receiver's option, accepted and
    ignored here so one ``weight_transport_args`` table serves both sides. Blocks left behind by
    senders that were killed (their process is gone) are unlinked when a sender is built.

    A target is an engine base URL (``http://127.0.0.1:PORT``) or a callable taking the payload
    (an engine in the same process).
    """

    def __init__(self, bucket_bytes: int = 64 << 20, split_large: bool = True, num_buffers: int = 2,
                 timeout_s: float = 600.0, copy: bool | None = None, delta: bool = False,
                 full_every: int = 100) -> None:
        if int(bucket_bytes) < 64:
            raise ValueError(f"shm weight transport: bucket_bytes must be >= 64, got {bucket_bytes}")
        self.delta = DeltaEncoder(full_every, LOAD_FORMAT) if delta else None
        if int(num_buffers) < 1:
            raise ValueError(f"shm weight transport: num_buffers must be >= 1, got {num_buffers}")
        self.bucket_bytes = int(bucket_bytes)
        self.split_large = bool(split_large)
        self.num_buffers = int(num_buffers)
        self.timeout_s = float(timeout_s)
        self._blocks: list[shared_memory.SharedMemory | None] = [None] * self.num_buffers
        self._retired: list[str] = []
        self._client: Any = None
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _release_blocks, self._blocks)
        reclaim_orphan_blocks()

    # -- blocks --------------------------------------------------------------------------------

    def _block_for(self, slot: int, size: int) -> shared_memory.SharedMemory:
        block = self._blocks[slot]
        if block is not None and block.size >= size:
            return block
        if block is not None:
            self._retired.append(block.name)
            _release_blocks([block])
        block = shared_memory.SharedMemory(name=_block_name(), create=True, size=max(size, self.bucket_bytes, 1))
        self._blocks[slot] = block
        return block

    @property
    def block_names(self) -> list[str]:
        """Names of the shared-memory blocks currently held (for inspection and tests)."""
        return [b.name for b in self._blocks if b is not None]

    # -- delivery ------------------------------------------------------------------------------

    def _deliver(self, target: Any, payload: dict[str, Any]) -> None:
        if callable(target):
            target(payload)
            return
        if not isinstance(target, str):
            raise TypeError(f"shm weight transport: a target must be an engine base URL or a callable, got {target!r}")
        import httpx

        with self._lock:
            if self._client is None:
                self._client = httpx.Client(timeout=self.timeout_s, trust_env=False, headers=engine_headers())
            client = self._client
        url = target.rstrip("/") + ENDPOINT
        try:
            response = client.post(url, json=payload)
        except httpx.HTTPError as exc:
            raise WeightTransferError(f"shm weight transport: POST {url} failed: {exc}") from exc
        if response.status_code != 200:
            raise WeightTransferError(f"shm weight transport: engine {target} answered {response.status_code} to "
                                      f"weight version {payload['weight_version']}: {response.text[:500]}")
        try:
            body = response.json()
        except ValueError:
            return
        if isinstance(body, dict) and body.get("success") is False:
            raise WeightTransferError(f"shm weight transport: engine {target} rejected weight version "
                                      f"{payload['weight_version']}: {body.get('message', body)}")

    # -- sending -------------------------------------------------------------------------------

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: int,
             targets: list[Any]) -> dict[str, float]:
        """Push ``weights`` to every target as weight version ``version``; returns timing metrics."""
        if self.delta is None:
            metrics = self._send_once(weights, version, targets, None)
            return {**metrics, **sync_metrics(int(metrics["perf/weight_update_bytes"]),
                                              int(metrics["perf/weight_update_bytes"]))}
        return send_synced(self.delta, weights,
                           lambda stream, record: self._send_once(stream, version, targets, record),
                           lambda exc: MISMATCH_MARK in str(exc))

    def _send_once(self, weights: Iterable[tuple[str, torch.Tensor]], version: int, targets: list[Any],
                   record: dict[str, Encoded] | None) -> dict[str, float]:
        start_time = time.perf_counter()
        packer = BucketPacker(self.bucket_bytes, split_large=self.split_large)
        lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="shm-weights") for _ in targets]
        in_flight: dict[int, list[Future[None]]] = {}
        total = 0
        views: dict[int, torch.Tensor] = {}
        open_bucket = -1
        slot_of: dict[int, int] = {}

        def wait(slot: int) -> None:
            for fut in in_flight.pop(slot, []):
                fut.result()

        def submit(index: int, last: bool) -> None:
            slot = slot_of[index]
            block = self._blocks[slot]
            names = (e.meta.name for e in packer.buckets[index])
            extra = {} if record is None else {"delta": delta_infos(record, names)}
            meta = encode_bucket(packer, index, version=version, last=last,
                                 shm_name=block.name if block is not None else None,
                                 shm_size=block.size if block is not None else 0, retired=self._retired, **extra)
            self._retired = []
            payload = {"load_format": LOAD_FORMAT, "serialized_named_tensors": meta, "weight_version": version,
                       "flush_cache": last}
            in_flight[slot] = [lane.submit(self._deliver, target, payload) for lane, target in zip(lanes, targets)]

        try:
            for name, tensor in weights:
                src = tensor_bytes(tensor)
                nbytes = src.numel()
                total += nbytes
                for piece in packer.place(name, tuple(tensor.shape), dtype_name(tensor.dtype), nbytes):
                    if piece.bucket != open_bucket:
                        if open_bucket >= 0:
                            submit(open_bucket, last=False)
                        open_bucket = piece.bucket
                        slot = piece.bucket % self.num_buffers
                        slot_of[piece.bucket] = slot
                        wait(slot)
                        views.pop(slot, None)
                    slot = slot_of[piece.bucket]
                    need = piece.offset + piece.nbytes
                    block = self._blocks[slot]
                    if block is None or block.size < need:
                        views.pop(slot, None)
                        block = self._block_for(slot, need)
                    if slot not in views:
                        views[slot] = torch.frombuffer(block.buf, dtype=torch.uint8, count=block.size)
                    if piece.nbytes:
                        views[slot][piece.offset:piece.offset + piece.nbytes].copy_(
                            src[piece.start:piece.start + piece.nbytes])
            if open_bucket < 0:  # nothing to send: still announce the version
                open_bucket = 0
                slot_of[0] = 0
            submit(open_bucket, last=True)
            for slot in list(in_flight):
                wait(slot)
        finally:
            views.clear()
            for lane in lanes:
                lane.shutdown(wait=True, cancel_futures=True)
        seconds = time.perf_counter() - start_time
        return {"perf/weight_update_bytes": float(total), "perf/weight_update_buckets": float(open_bucket + 1),
                "timing/weight_update_s": seconds,
                "perf/weight_update_gb_per_s": total * max(1, len(targets)) / max(seconds, 1e-9) / 1e9}

    def close(self) -> None:
        """Release the shared-memory blocks and the HTTP client (idempotent)."""
        self._finalizer()
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> "ShmSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Receiver
# ---------------------------------------------------------------------------------------------


class _Mapping:
    """A read-write mapping of a shared-memory block created by another process.

    On POSIX the block is opened with ``shm_open`` directly, so this process does not register it
    with Python's resource tracker (which would unlink the sender's block when this process exits).
    The mapping is never unmapped explicitly: tensors handed out hold a reference to it, and it is
    unmapped when the last of them (and this object) is gone, so a view can never dangle.
    """

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        try:
            import _posixshmem
        except ImportError:  # pragma: no cover - Windows: named file mappings
            self._mmap: Any = mmap.mmap(-1, size, tagname=name)  # type: ignore[call-arg]
        else:
            try:
                fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            except FileNotFoundError:
                raise FileNotFoundError(f"shm weight transport: shared-memory block {name!r} does not exist "
                                        "(the sender closed it or runs on another node)") from None
            try:
                self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        self.bytes: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def close(self) -> None:
        """Drop this object's references (the memory stays mapped while yielded views live)."""
        self.bytes = None
        self._mmap = None


class ShmReceiver:
    """Engine side of the ``shm`` transport (``WeightReceiver``).

    ``copy=False`` (default) yields views into the shared block, valid until the engine answers
    the request; ``copy=True`` yields independent tensors. Tensors split across buckets are
    reassembled and yielded once their last piece has arrived, so an engine keeps one receiver for
    all requests of an update. The sender's options are accepted and ignored (one shared table).
    """

    def __init__(self, copy: bool = False, bucket_bytes: int | None = None, split_large: bool | None = None,
                 num_buffers: int | None = None, timeout_s: float | None = None, delta: bool | None = None,
                 full_every: int | None = None) -> None:
        self.copy = bool(copy)
        self._delta = DeltaDecoder(LOAD_FORMAT)
        self._mappings: dict[str, _Mapping] = {}
        self._assembler = BucketAssembler(LOAD_FORMAT)
        self._finalizer = weakref.finalize(self, _close_mappings, self._mappings)

    def _mapping(self, name: str, size: int) -> _Mapping:
        mapping = self._mappings.get(name)
        if mapping is None:
            mapping = self._mappings[name] = _Mapping(name, size)
        return mapping

    def receive(self, payload: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of one update request (``payload`` is the request's JSON body)."""
        if payload.get("load_format", LOAD_FORMAT) != LOAD_FORMAT:
            raise ValueError(f"shm weight transport: payload has load_format {payload.get('load_format')!r}")
        if "serialized_named_tensors" not in payload:
            raise KeyError("shm weight transport: the payload has no 'serialized_named_tensors'")
        decoded: DecodedBucket = decode_bucket(payload["serialized_named_tensors"])
        for name in decoded.retired:
            mapping = self._mappings.pop(name, None)
            if mapping is not None:
                mapping.close()
        data = self._mapping(decoded.shm_name, decoded.shm_size).bytes if decoded.shm_name else None
        pairs = self._assembler.tensors(decoded, data, copy=self.copy and "delta" not in decoded.fields)
        if "delta" not in decoded.fields:
            yield from pairs
            return
        try:  # tensors are rebuilt from this receiver's own copy of the last bytes and checked
            yield from self._delta.decode(pairs, decoded.fields["delta"])
        except DeltaMismatchError:
            self._assembler.reset()
            raise

    def close(self) -> None:
        """Forget every cached block (each is unmapped once no yielded view refers to it)."""
        self._finalizer()


def _close_mappings(mappings: dict[str, _Mapping]) -> None:
    for mapping in mappings.values():
        mapping.close()
    mappings.clear()


def payload_target(receiver: ShmReceiver,
                   sink: Callable[[str, torch.Tensor], None]) -> Callable[[Mapping[str, Any]], None]:
    """A sender target that feeds each payload to ``receiver`` in this process and hands every
    tensor to ``sink(name, tensor)`` (which must copy it)."""

    def deliver(payload: Mapping[str, Any]) -> None:
        for name, tensor in receiver.receive(payload):
            sink(name, tensor)

    return deliver
