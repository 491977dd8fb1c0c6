"""Delta weight sync: send only the bytes that changed since the last sync, verified per tensor.

Used by the ``shm`` and ``broadcast`` transports with ``delta = true``. The sender keeps a copy
of the bytes every engine holds (what it sent last, in the dtype it sends: ``[model] dtype``,
i.e. the engine-side precision, not the float32 master weights); at RL learning rates most
elements keep their bfloat16 representation from one step to the next, so the XOR of the new
bytes against that copy is mostly zeros. Each tensor travels as one of

* ``full``: its bytes (the first sync, a resume, every ``full_every`` versions, or the fallback);
* ``same``: nothing (no element changed);
* ``xor_zstd``: the XOR against the last-sent bytes, compressed with zstd;
* ``sparse``: the int32 indices of the changed elements followed by their new values;

whichever of the last two is smaller. Every tensor carries the xxh3-64 checksum of its full new
bytes; the receiver, which keeps its own copy of what it last received, rebuilds the bytes,
checks them and raises :class:`DeltaMismatchError` (whose message holds :data:`MISMATCH_MARK`)
without yielding a tensor that fails. The sender then sends that version again in full, so an
engine never keeps weights that differ from a full sync's.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping

import attrs
import torch
import xxhash
import zstandard

from ..engine.weights import WeightUpdateError
from .buckets import dtype_from_name, dtype_name, tensor_bytes

log = logging.getLogger(__name__)

MISMATCH_MARK = "weight delta checksum mismatch"
"""Part of the error a receiver answers when a rebuilt tensor fails its checksum (or it holds no
base for a delta); the sender recognises it and falls back to a full sync of that version."""

ZSTD_LEVEL = 1
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaMismatchError(WeightUpdateError):
    """A rebuilt tensor does not match the sender's checksum; the tensor was not applied (the
    engine answers 400 with this message)."""


def checksum(data: torch.Tensor) -> str:
    """xxh3-64 of a flat CPU ``uint8`` tensor's bytes, as hex."""
    return xxhash.xxh3_64_hexdigest(memoryview(data.numpy()))  # type: ignore[arg-type]


def _elements(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    """``data`` (flat ``uint8``) viewed as integers of the tensor's element size."""
    return data.view(_INT_OF_SIZE[itemsize]) if itemsize in _INT_OF_SIZE else data


@attrs.define
class Encoded:
    """One tensor as it travels: ``payload`` (flat ``uint8``) and the ``info`` the receiver needs."""

    name: str
    payload: torch.Tensor | None
    info: dict[str, Any]
    full_nbytes: int
    sent_nbytes: int = 0


def _cpu_bytes(tensor: torch.Tensor) -> torch.Tensor:
    data = tensor_bytes(tensor)
    return data if data.device.type == "cpu" else data.cpu()


class DeltaEncoder:
    """Sender side: turns each tensor into its smallest encoding against the last-sent bytes.

    ``full_every``: every this many versions the whole model is sent (and the copy restarted), so
    a receiver that drifted for a reason no checksum saw is healed; 0 never forces one.
    """

    def __init__(self, full_every: int = 100, transport: str = "weight") -> None:
        if int(full_every) < 0:
            raise ValueError(f"{transport} weight transport: full_every must be >= 0, got {full_every}")
        self.full_every = int(full_every)
        self.transport = transport
        self.last_sent: dict[str, tuple[torch.Tensor, tuple[int, ...], torch.dtype]] = {}
        self.syncs_since_full = 0
        self.last_encodings: dict[str, str] = {}
        """How each tensor travelled in the last sync (``full``, ``same``, ``xor_zstd``, ``sparse``)."""
        self.engine_dtype: torch.dtype | None = None
        """Floating tensors wider than this are cast to it before encoding (the engine's precision,
        ``[rollout] engine_args.dtype``): the engine would cast them on load anyway, with the same
        rounding, so only changes it can see are sent."""
        self._compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)

    def needs_full(self) -> bool:
        """Whether the next sync must be full: nothing sent yet (first sync, resume) or ``full_every`` reached."""
        return not self.last_sent or (self.full_every > 0 and self.syncs_since_full + 1 >= self.full_every)

    def encode(self, weights: Iterable[tuple[str, torch.Tensor]], *, full: bool) -> Iterator[Encoded]:
        """The encodings of ``weights``, recording each tensor's new bytes as what receivers hold."""
        if full:
            self.last_sent.clear()
            self.syncs_since_full = 0
        else:
            self.syncs_since_full += 1
        for name, tensor in weights:
            owned = False  # whether ``tensor`` is a copy made here (else it may be the live parameter)
            if (self.engine_dtype is not None and tensor.is_floating_point() and tensor.dtype != self.engine_dtype
                    and tensor.element_size() > self.engine_dtype.itemsize):
                tensor, owned = tensor.to(self.engine_dtype), True
            new = _cpu_bytes(tensor)
            itemsize = tensor.element_size()
            info: dict[str, Any] = {"shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype),
                                    "nbytes": new.numel(), "checksum": checksum(new)}
            previous = self.last_sent.get(name)
            if full or previous is None or previous[0].numel() != new.numel() or itemsize not in _INT_OF_SIZE:
                payload, kind = new, "full"
            else:
                payload, kind = self._delta(previous[0], new, itemsize)
                if payload.numel() >= new.numel():  # most elements changed: the bytes themselves are smaller
                    payload, kind = new, "full"
            # a CPU tensor's bytes may be the live parameter itself: keep a copy of them
            stored = new.clone() if tensor.device.type == "cpu" and not owned else new
            self.last_sent[name] = (stored, tuple(tensor.shape), tensor.dtype)
            info["encoding"] = kind
            yield Encoded(name, payload, info, new.numel(), payload.numel())

    def _delta(self, old: torch.Tensor, new: torch.Tensor, itemsize: int) -> tuple[torch.Tensor, str]:
        xor = torch.bitwise_xor(old, new)
        count = int(torch.count_nonzero(_elements(xor, itemsize)))
        if count == 0:
            return torch.empty(0, dtype=torch.uint8), "same"
        packed = self._compressor.compress(memoryview(xor.numpy()))  # type: ignore[arg-type]
        if len(packed) < count * (4 + itemsize):  # the indices are listed only when they are smaller
            return torch.frombuffer(bytearray(packed), dtype=torch.uint8), "xor_zstd"
        changed = torch.nonzero(_elements(xor, itemsize)).reshape(-1)
        values = _elements(new, itemsize)[changed]
        return torch.cat([changed.to(torch.int32).view(torch.uint8), values.view(torch.uint8)]), "sparse"

    def recorded(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
        """The tensors ``names`` as last recorded (to resend in full a sync that failed part way)."""
        out = []
        for name in names:
            data, shape, dtype = self.last_sent[name]
            out.append((name, data.view(dtype).reshape(shape)))
        return out


class DeltaDecoder:
    """Receiver side: rebuilds each tensor from its encoding and its own copy of the last bytes."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.held: dict[str, torch.Tensor] = {}
        self._decompressor = zstandard.ZstdDecompressor()

    def decode(self, pairs: Iterable[tuple[str, torch.Tensor]],
               infos: Mapping[str, Mapping[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The rebuilt ``(name, tensor)`` of each ``(name, payload)``; :class:`DeltaMismatchError`
        (nothing yielded for that tensor) when one fails its checksum or has no base."""
        for name, payload in pairs:
            info = infos.get(name)
            if info is None:
                raise ValueError(f"{self.transport} weight transport: delta bucket has no encoding for {name!r}")
            data = self._rebuild(name, payload.reshape(-1).view(torch.uint8), info)
            if checksum(data) != info["checksum"]:
                self.held.pop(name, None)
                raise DeltaMismatchError(f"{self.transport} weight transport: {MISMATCH_MARK} for {name!r} "
                                         f"({info['encoding']}); the tensor was not applied")
            self.held[name] = data
            yield name, data.view(dtype_from_name(info["dtype"])).reshape(tuple(info["shape"]))

    def _rebuild(self, name: str, payload: torch.Tensor, info: Mapping[str, Any]) -> torch.Tensor:
        kind, nbytes = info["encoding"], int(info["nbytes"])
        if kind == "full":
            return payload.cpu().clone()
        old = self.held.get(name)
        if old is None or old.numel() != nbytes:
            raise DeltaMismatchError(f"{self.transport} weight transport: {MISMATCH_MARK} for {name!r}: this engine "
                                     f"holds no base for a delta ({kind})")
        if kind == "same":
            return old
        itemsize = dtype_from_name(info["dtype"]).itemsize
        payload = payload.cpu()
        if kind == "xor_zstd":
            # decompressed straight into a new tensor, then XORed in place: no intermediate copy
            data = torch.empty(nbytes, dtype=torch.uint8)
            got = 0
            try:
                with self._decompressor.stream_reader(memoryview(payload.numpy())) as reader:  # type: ignore[arg-type]
                    view = memoryview(data.numpy())  # type: ignore[arg-type]
                    while got < nbytes:
                        n = reader.readinto(view[got:])
                        if not n:
                            break
                        got += n
            except zstandard.ZstdError as exc:
                raise DeltaMismatchError(f"{self.transport} weight transport: {MISMATCH_MARK} for {name!r}: "
                                         f"corrupt zstd data ({exc})") from None
            if got != nbytes:
                raise DeltaMismatchError(f"{self.transport} weight transport: {MISMATCH_MARK} for {name!r}: "
                                         f"{got} bytes decompressed, expected {nbytes}")
            return torch.bitwise_xor(old, data, out=data)
        if kind == "sparse":
            count = payload.numel() // (4 + itemsize)
            index = payload[:count * 4].clone().view(torch.int32).long()
            values = payload[count * 4:count * (4 + itemsize)].clone()
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= nbytes // itemsize):
                raise DeltaMismatchError(f"{self.transport} weight transport: {MISMATCH_MARK} for {name!r}: "
                                         "sparse index out of range")
            data = old.clone()
            _elements(data, itemsize)[index] = _elements(values, itemsize)
            return data
        raise ValueError(f"{self.transport} weight transport: unknown delta encoding {kind!r} for {name!r}")


def engine_dtype(ctx: Any) -> torch.dtype | None:
    """The engine's own precision from the job of a transport context (``[rollout]
    engine_args.dtype``), or None when the engine runs in ``[model] dtype``."""
    rollout = getattr(getattr(ctx, "job", None), "rollout", None)
    name = (getattr(rollout, "engine_args", None) or {}).get("dtype")
    return dtype_from_name(name) if isinstance(name, str) else None


def delta_infos(encoded: Mapping[str, Encoded], names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The ``delta`` field of a bucket holding (pieces of) ``names``."""
    return {name: encoded[name].info for name in names if name in encoded}


def as_stream(encoded: Iterable[Encoded], record: dict[str, Encoded]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, payload)`` pairs a bucket packer takes, remembering each encoding (without its
    bytes, which the packer copies and drops) in ``record``."""
    for item in encoded:
        assert item.payload is not None
        record[item.name] = attrs.evolve(item, payload=None)
        yield item.name, item.payload


def sync_metrics(sent: int, full: int) -> dict[str, float]:
    """``perf/weight_sync_bytes`` (bytes moved), ``perf/weight_sync_full_bytes`` (what a full sync
    moves) and ``perf/weight_sync_delta_ratio`` (the first over the second)."""
    return {"perf/weight_sync_bytes": float(sent), "perf/weight_sync_full_bytes": float(full),
            "perf/weight_sync_delta_ratio": sent / full if full else 1.0}


def send_synced(encoder: DeltaEncoder, weights: Iterable[tuple[str, torch.Tensor]],
                send_once: Callable[[Iterator[tuple[str, torch.Tensor]], dict[str, Encoded]], dict[str, float]],
                is_mismatch: Callable[[BaseException], bool]) -> dict[str, float]:
    """One delta sync: ``send_once(stream, record)`` sends the encoded stream (filling ``record``,
    the encodings by name, read by the transport for each bucket's ``delta`` field); when a
    receiver reports a mismatch (``is_mismatch``), the version is sent again in full: the tensors
    already encoded from the copy just recorded, then the rest of ``weights``."""
    source = iter(weights)
    full = encoder.needs_full()
    record: dict[str, Encoded] = {}
    try:
        metrics = send_once(as_stream(encoder.encode(source, full=full), record), record)
        sent = sum(e.sent_nbytes for e in record.values())
        fallbacks = 0
    except Exception as exc:
        if full or not is_mismatch(exc):
            raise
        log.warning("%s; sending this version in full", str(exc).splitlines()[0][:300])
        sent = sum(e.sent_nbytes for e in record.values())
        stream = itertools.chain(encoder.recorded(list(record)), source)
        record = {}
        metrics = send_once(as_stream(encoder.encode(stream, full=True), record), record)
        sent += sum(e.sent_nbytes for e in record.values())
        full, fallbacks = True, 1
    encoder.last_encodings = {name: e.info["encoding"] for name, e in record.items()}
    metrics.update(sync_metrics(sent, sum(e.full_nbytes for e in record.values())))
    metrics["perf/weight_sync_full"] = float(full)
    metrics["perf/weight_sync_fallbacks"] = float(fallbacks)
    return metrics
