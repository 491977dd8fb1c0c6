"""Packing named tensors into flat byte buckets, the bucket metadata sent ahead of the bytes, and
turning received bytes back into tensors. Shared by the ``shm`` and ``broadcast`` transports.

A bucket holds up to ``bucket_bytes`` bytes; each tensor starts at a 64-byte aligned offset. A
tensor larger than a bucket either gets a bucket of its own size (``split_large=False``) or is
cut into byte ranges that continue across consecutive buckets (``split_large=True``, memory stays
bounded by the bucket size). The metadata is a :class:`loongsage_hookspecs.WeightBucket` whose
:class:`~loongsage_hookspecs.TensorMeta` entries say where each piece lies, plus, per entry, the
piece's byte range inside the whole tensor. Tensors travel as raw bytes, so every dtype
(bfloat16 included) arrives bit-exact.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterator

import attrs

from loongsage_hookspecs import TensorMeta, WeightBucket

if TYPE_CHECKING:  # pragma: no cover
    import torch

ALIGN = 64
FORMAT = "loongsage.bucket.v1"


def dtype_name(dtype: "torch.dtype") -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> "torch.dtype":
    """``"bfloat16"`` -> ``torch.bfloat16``; a clear error for anything that is not a torch dtype."""
    import torch

    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"weight transport: unknown dtype {name!r}")
    return value


def tensor_bytes(tensor: "torch.Tensor") -> "torch.Tensor":
    """A flat ``uint8`` view of ``tensor``'s bytes (contiguous copy only when needed)."""
    import torch

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def align(n: int) -> int:
    """``n`` rounded up to the bucket alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@attrs.define
class Piece:
    """Where (part of) one tensor goes: bucket ``bucket``, bytes ``[offset, offset + nbytes)`` of it,
    holding bytes ``[start, start + nbytes)`` of the tensor's ``total_nbytes``."""

    bucket: int
    offset: int
    start: int
    nbytes: int
    total_nbytes: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.nbytes == self.total_nbytes


@attrs.define
class BucketEntry:
    """One piece as recorded in a bucket's metadata."""

    meta: TensorMeta
    start: int
    total_nbytes: int


class BucketPacker:
    """Assigns tensors, in the order given, to bucket positions (a streaming first-fit in order)."""

    def __init__(self, bucket_bytes: int, *, split_large: bool) -> None:
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
        self.capacity = int(bucket_bytes)
        self.split_large = split_large
        self.buckets: list[list[BucketEntry]] = [[]]
        self.sizes: list[int] = [0]

    @property
    def index(self) -> int:
        """The bucket now being filled."""
        return len(self.buckets) - 1

    def _new_bucket(self) -> None:
        self.buckets.append([])
        self.sizes.append(0)

    def _record(self, name: str, shape: tuple[int, ...], dtype: str, piece: Piece) -> Piece:
        self.buckets[-1].append(BucketEntry(TensorMeta(name=name, shape=tuple(shape), dtype=dtype,
                                                       offset=piece.offset, nbytes=piece.nbytes),
                                            start=piece.start, total_nbytes=piece.total_nbytes))
        self.sizes[-1] = max(self.sizes[-1], piece.offset + piece.nbytes)
        return piece

    def place(self, name: str, shape: tuple[int, ...], dtype: str, nbytes: int) -> Iterator[Piece]:
        """Pieces of one tensor of ``nbytes`` bytes, in order (a new bucket index means the previous
        bucket is complete)."""
        if nbytes <= self.capacity or not self.split_large:
            offset = align(self.sizes[-1]) if self.buckets[-1] else 0
            if self.buckets[-1] and offset + nbytes > self.capacity:
                self._new_bucket()
                offset = 0
            yield self._record(name, shape, dtype, Piece(self.index, offset, 0, nbytes, nbytes))
            return
        start = 0
        while start < nbytes:
            offset = align(self.sizes[-1]) if self.buckets[-1] else 0
            if offset >= self.capacity:
                self._new_bucket()
                offset = 0
            n = min(self.capacity - offset, nbytes - start)
            yield self._record(name, shape, dtype, Piece(self.index, offset, start, n, nbytes))
            start += n

    def bucket(self, index: int, *, version: int, last: bool) -> WeightBucket:
        """The metadata of bucket ``index``."""
        return WeightBucket(version=version, index=index, tensors=[e.meta for e in self.buckets[index]], last=last)


def encode_bucket(packer: BucketPacker, index: int, *, version: int, last: bool, **fields: Any) -> str:
    """JSON text describing bucket ``index``: the :class:`WeightBucket` fields, its byte ``size``,
    piece ranges, and whatever ``fields`` the transport adds (the ``shm`` transport names its
    shared-memory block and the blocks it retired)."""
    bucket = packer.bucket(index, version=version, last=last)
    tensors = []
    for entry in packer.buckets[index]:
        item = attrs.asdict(entry.meta)
        item["shape"] = list(item["shape"])
        item["part_start"] = entry.start
        item["total_nbytes"] = entry.total_nbytes
        tensors.append(item)
    return json.dumps({**fields, "format": FORMAT, "version": bucket.version, "index": bucket.index,
                       "last": bucket.last, "size": packer.sizes[index], "tensors": tensors})


@attrs.define
class DecodedBucket:
    """A bucket's metadata as the receiver reads it (``fields``: what the transport added)."""

    bucket: WeightBucket
    size: int
    entries: list[BucketEntry]
    fields: dict[str, Any] = attrs.field(factory=dict)

    @property
    def shm_name(self) -> str | None:
        return self.fields.get("shm_name")

    @property
    def shm_size(self) -> int:
        return int(self.fields.get("shm_size", 0))

    @property
    def retired(self) -> list[str]:
        return list(self.fields.get("retired", []))


def decode_bucket(text: Any) -> DecodedBucket:
    """Parse what :func:`encode_bucket` wrote (a JSON string, bytes, a one-element list of them, or a dict)."""
    if isinstance(text, list):
        if len(text) != 1:
            raise ValueError(f"weight transport: expected one serialized bucket, got {len(text)}")
        text = text[0]
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    data = json.loads(text) if isinstance(text, str) else dict(text)
    if data.get("format") != FORMAT:
        raise ValueError(f"weight transport: bucket metadata has format {data.get('format')!r}, "
                         f"expected {FORMAT!r}")
    entries = [BucketEntry(TensorMeta(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"],
                                      offset=int(t["offset"]), nbytes=int(t["nbytes"])),
                           start=int(t["part_start"]), total_nbytes=int(t["total_nbytes"])) for t in data["tensors"]]
    bucket = WeightBucket(version=int(data["version"]), index=int(data["index"]), tensors=[e.meta for e in entries],
                          last=bool(data["last"]))
    known = {"format", "version", "index", "last", "size", "tensors"}
    return DecodedBucket(bucket=bucket, size=int(data.get("size", 0)), entries=entries,
                         fields={k: v for k, v in data.items() if k not in known})


class BucketAssembler:
    """Receiver side: the ``(name, tensor)`` pairs held in one bucket's bytes.

    A whole tensor is a view into ``data`` (or a copy with ``copy=True``); the pieces of a tensor
    split across buckets are gathered into a buffer of its own and yielded once the last piece is
    in, so one assembler must see every bucket of an update in order.
    """

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self._pending: dict[str, tuple["torch.Tensor", tuple[int, ...], "torch.dtype", int]] = {}

    def reset(self) -> None:
        """Drop the pieces of an update that will not complete (the sender starts it again)."""
        self._pending.clear()

    def tensors(self, decoded: DecodedBucket, data: "torch.Tensor | None", *,
                copy: bool = False) -> Iterator[tuple[str, "torch.Tensor"]]:
        import torch

        for entry in decoded.entries:
            meta = entry.meta
            dtype = dtype_from_name(meta.dtype)
            if meta.nbytes and (data is None or meta.offset + meta.nbytes > data.numel()):
                raise ValueError(f"{self.transport} weight transport: tensor {meta.name!r} lies outside the "
                                 f"bucket's {0 if data is None else data.numel()} bytes")
            chunk = data[meta.offset:meta.offset + meta.nbytes] if meta.nbytes and data is not None \
                else torch.empty(0, dtype=torch.uint8)
            if entry.start == 0 and meta.nbytes == entry.total_nbytes:
                tensor = chunk.view(dtype).reshape(meta.shape)
                yield meta.name, tensor.clone() if copy else tensor
                continue
            if entry.start == 0:  # a tensor starts again (a resend after a failed update): drop stale pieces
                self._pending.pop(meta.name, None)
            buffer, shape, _, received = self._pending.get(
                meta.name, (torch.empty(entry.total_nbytes, dtype=torch.uint8), meta.shape, dtype, 0))
            buffer[entry.start:entry.start + meta.nbytes].copy_(chunk)
            received += meta.nbytes
            if received == entry.total_nbytes:
                self._pending.pop(meta.name, None)
                yield meta.name, buffer.view(dtype).reshape(shape)
            else:
                self._pending[meta.name] = (buffer, shape, dtype, received)
        if decoded.bucket.last and self._pending:
            missing = sorted(self._pending)
            self._pending.clear()
            raise ValueError(f"{self.transport} weight transport: the last bucket of version "
                             f"{decoded.bucket.version} arrived but tensors {missing} are incomplete")
