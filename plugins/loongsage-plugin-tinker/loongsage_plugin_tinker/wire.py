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


TOPK_EMPTY = (0, -99999.0)
"""The (token id, log-prob) the SDK's dense top-k matrices hold where a position has no entry."""


def _topk(pb: Any, rows: Sequence[Sequence[tuple[int, float]] | None], k: int) -> Any:
    """A ``TopkLogprobs`` message: ``rows`` as dense ``[len(rows), k]`` matrices, padded with
    :data:`TOPK_EMPTY` (a ``None`` row is all padding)."""
    ids = np.full((len(rows), k), TOPK_EMPTY[0], dtype=np.int32)
    values = np.full((len(rows), k), TOPK_EMPTY[1], dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate((row or [])[:k]):
            ids[i, j], values[i, j] = token, logprob
    return pb.TopkLogprobs(length=len(rows), k=k, token_ids=ids.tobytes(), logprobs=values.tobytes())


def encode_sample_response(sampled: Any, *, topk_sample: int = 0, topk_prompt: int = 0) -> bytes:
    """A ``SampleResponse`` message of a :class:`~.sampling.Sampled` result: the sequences (with
    their ``topk_sample`` most likely tokens per position when asked), the prompt's log-probs
    (NaN where not scored, as the SDK reads them) and its ``topk_prompt`` most likely tokens."""
    pb = _pb()
    out = pb.SampleResponse()
    for seq in sampled.sequences:
        msg = out.sequences.add(stop_reason=pb.STOP_REASON_LENGTH if seq.stop_reason == "length"
                                else pb.STOP_REASON_STOP,
                                tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
                                logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes())
        if topk_sample:
            msg.topk_sampled_logprobs.CopyFrom(_topk(pb, seq.top or [None] * len(seq.tokens), topk_sample))
    if sampled.prompt_logprobs is not None:
        values = [np.nan if lp is None else lp for lp in sampled.prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if topk_prompt and sampled.prompt_top is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(pb, sampled.prompt_top, topk_prompt))
    return bytes(out.SerializeToString())
