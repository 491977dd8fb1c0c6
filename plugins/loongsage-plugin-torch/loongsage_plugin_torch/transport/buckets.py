"""Packing named tensors into flat byte buckets, and the bucket metadata sent ahead of the bytes.

A bucket holds up to ``bucket_bytes`` bytes; each tensor starts at a 64-byte aligned offset. A
tensor larger than a bucket either gets a bucket of its own size (``split_large=False``) or is
cut into byte ranges that continue across consecutive buckets (``split_large=True``, memory stays
bounded by the bucket size). The metadata is a :class:`loongsage_hookspecs.WeightBucket` whose
:class:`~loongsage_hookspecs.TensorMeta` entries say where each piece lies, plus, per entry, the
piece's byte range inside the whole tensor.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import attrs

from loongsage_hookspecs import TensorMeta, WeightBucket

ALIGN = 64
FORMAT = "loongsage.shm.v1"


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


def encode_bucket(packer: BucketPacker, index: int, *, version: int, last: bool, shm_name: str | None,
                  shm_size: int, retired: list[str]) -> str:
    """JSON text describing bucket ``index``: the :class:`WeightBucket` fields, the shared-memory
    block holding it, piece ranges, and the names of blocks the sender no longer uses."""
    bucket = packer.bucket(index, version=version, last=last)
    tensors = []
    for entry in packer.buckets[index]:
        item = attrs.asdict(entry.meta)
        item["shape"] = list(item["shape"])
        item["part_start"] = entry.start
        item["total_nbytes"] = entry.total_nbytes
        tensors.append(item)
    return json.dumps({"format": FORMAT, "version": bucket.version, "index": bucket.index, "last": bucket.last,
                       "shm_name": shm_name, "shm_size": shm_size, "retired": list(retired), "tensors": tensors})


@attrs.define
class DecodedBucket:
    """A bucket's metadata as the receiver reads it."""

    bucket: WeightBucket
    shm_name: str | None
    shm_size: int
    retired: list[str]
    entries: list[BucketEntry]


def decode_bucket(text: Any) -> DecodedBucket:
    """Parse what :func:`encode_bucket` wrote (a JSON string, bytes, a one-element list of them, or a dict)."""
    if isinstance(text, list):
        if len(text) != 1:
            raise ValueError(f"shm weight transport: expected one serialized bucket, got {len(text)}")
        text = text[0]
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    data = json.loads(text) if isinstance(text, str) else dict(text)
    if data.get("format") != FORMAT:
        raise ValueError(f"shm weight transport: bucket metadata has format {data.get('format')!r}, "
                         f"expected {FORMAT!r}")
    entries = [BucketEntry(TensorMeta(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"],
                                      offset=int(t["offset"]), nbytes=int(t["nbytes"])),
                           start=int(t["part_start"]), total_nbytes=int(t["total_nbytes"])) for t in data["tensors"]]
    bucket = WeightBucket(version=int(data["version"]), index=int(data["index"]), tensors=[e.meta for e in entries],
                          last=bool(data["last"]))
    return DecodedBucket(bucket=bucket, shm_name=data.get("shm_name"), shm_size=int(data.get("shm_size", 0)),
                         retired=list(data.get("retired", [])), entries=entries)
