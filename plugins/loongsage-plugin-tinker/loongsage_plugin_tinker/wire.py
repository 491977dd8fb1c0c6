"""The protobuf half of the Tinker wire format, read and written with the SDK's published schema.

``forward_backward`` requests arrive as ``tinker_public.ForwardBackwardRequest`` messages
(``application/x-protobuf``, zstd-compressed when the client says so), and the SDK accepts
``ForwardBackwardOutput`` and ``SampleResponse`` results only as protobuf. Everything else is JSON
(:mod:`.app`). Only text inputs are supported: image and audio chunks, sparse tensors and
unknown dtypes are refused.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

from .batches import Datum, TinkerRequestError

_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}


def _pb() -> Any:
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@attrs.define
class FwdBwdRequest:
    """A decoded ``/api/v1/forward_backward`` body."""

    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def _tensor(msg: Any, where: str) -> np.ndarray:
    if msg.HasField("sparse_csr"):
        raise TinkerRequestError(f"{where}: sparse tensors are not supported")
    dtype = _DTYPES.get(int(msg.dtype))
    if dtype is None:
        raise TinkerRequestError(f"{where}: tensor dtype {msg.dtype} is not supported (float32, int64)")
    arr = np.frombuffer(msg.dense, dtype=dtype)
    return arr.reshape(list(msg.shape)) if len(msg.shape) else arr


def decode_forward_backward(body: bytes, content_encoding: str | None) -> FwdBwdRequest:
    """The request of a ``forward_backward`` body (raises :class:`TinkerRequestError`)."""
    if content_encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
    elif content_encoding:
        raise TinkerRequestError(f"forward_backward: Content-Encoding {content_encoding!r} is not supported")
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise TinkerRequestError(f"forward_backward: the body is not a ForwardBackwardRequest message: {exc}") from None
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise TinkerRequestError(f"forward_backward: loss_fn_config[{key!r}] must be a number")
        config[key] = float(value.number)
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise TinkerRequestError(f"data[{i}].model_input.chunks[{j}]: {kind} chunks are not supported "
                                         "(text models only)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {key: _tensor(t, f"data[{i}].loss_fn_inputs[{key!r}]").reshape(-1)
                  for key, t in datum.loss_fn_inputs.items()}
        data.append(Datum(tokens=tokens, inputs=inputs))
    return FwdBwdRequest(model_id=msg.model_id, seq_id=int(msg.seq_id) if msg.seq_id else None,
                         loss_fn=msg.loss_fn, loss_fn_config=config, forward_only=bool(msg.forward_only), data=data)


def encode_forward_backward_output(outputs: Sequence[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput`` message: one ``ArrayRecord`` with each field batched over datums."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    if outputs:
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
        for name in outputs[0]:
            arrays = [np.ascontiguousarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
            offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
            record.fields[name].CopyFrom(pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays),
                                                          offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    return bytes(out.SerializeToString())


def encode_sample_response(sequences: Sequence[tuple[Sequence[int], Sequence[float], str]]) -> bytes:
    """A ``SampleResponse`` message of ``(tokens, logprobs, stop_reason)`` sequences."""
    pb = _pb()
    out = pb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_LENGTH if stop == "length" else pb.STOP_REASON_STOP,
                          tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(logprobs, dtype=np.float32).tobytes())
    return bytes(out.SerializeToString())
