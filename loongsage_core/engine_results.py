"""Reading a rollout engine's answers: generations, streamed chunks and errors.

:class:`GenerationResult` is the one reader of SGLang's ``/generate`` response format (the embedded
engine speaks it too); :func:`merge_stream_chunk` folds streamed chunks, cumulative or incremental,
into it. Per-token weight versions come from the LoongSage field
``meta_info.output_token_weight_versions`` when present, else from SGLang's
``meta_info.weight_versions`` spans, else from ``meta_info.weight_version`` repeated; weight versions
that are decimal strings (SGLang's type) become ints (:func:`as_version`). A mixture-of-experts
engine asked for ``return_routed_experts`` answers ``meta_info.routed_experts`` (base64 of int32
``[prompt + output - 1, layers, top_k]``), read into a :class:`~loongsage_hookspecs.RoutedExperts`.
A 4xx/5xx answer becomes an :class:`EngineError` with the engine's own message
(:func:`check_response`).

Split out of :mod:`loongsage_core.engine_client` (which re-exports these names) so the wire format
reads apart from the HTTP calls; importing it imports neither httpx nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import attrs

from loongsage_hookspecs import RoutedExperts, parse_weight_version

if TYPE_CHECKING:  # pragma: no cover
    import httpx

class EngineError(RuntimeError):
    """The engine answered with an error status; ``message`` is the engine's own explanation."""

    def __init__(self, status_code: int, message: str, path: str, param: str | None = None) -> None:
        super().__init__(f"engine {path} failed with HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.path = path
        self.param = param


class EngineProtocolError(EngineError):
    """The engine answered, but not in SGLang's format (a malformed ``/generate`` body or stream)."""

    def __init__(self, message: str, path: str = "/generate") -> None:
        super().__init__(502, message, path)


def as_version(value: Any) -> int | str | None:
    """A weight version as an int when it is one (SGLang sends strings), else unchanged."""
    version = parse_weight_version(value)
    return value if version is None else version


@attrs.define
class GenerationResult:
    """One generated sequence.

    ``logprobs[i]`` is the engine's log-probability of ``output_ids[i]`` (``None`` entries when the
    engine gave none); ``weight_versions[i]`` the weight version that produced it;
    ``finish_reason`` is ``"stop"``, ``"length"`` or ``"abort"`` (details in ``finish_detail``).
    """

    rid: str
    output_ids: list[int]
    logprobs: list[float | None] | None
    finish_reason: str
    finish_detail: dict[str, Any]
    weight_version: int | str | None
    weight_versions: list[int | str | None]
    prompt_tokens: int
    cached_tokens: int
    text: str
    meta_info: dict[str, Any] = attrs.field(repr=False)
    top_logprobs: list[list[tuple[float, int]]] | None = None  # per token: (log-prob, token id) of the most likely
    #: ``return_routed_experts``: the experts of every position the engine ran (prompt and output
    #: tokens but the last), ``None`` when not asked or not given
    routed_experts: RoutedExperts | None = attrs.field(default=None, repr=False)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    def token_record(self) -> tuple[list[float], list[int]]:
        """Log-probs and weight versions of ``output_ids`` as a :class:`~loongsage_hookspecs.Segment`
        records them, by the AgentFlow router's rule: one log-prob per token (an entry the engine
        left empty counts 0.0) and integer versions (-1 where unknown). An answer without one
        log-prob per token is a ``ValueError`` naming the request."""
        n = len(self.output_ids)
        if self.logprobs is None or len(self.logprobs) != n:
            got = "no" if self.logprobs is None else str(len(self.logprobs))
            raise ValueError(f"request {self.rid!r}: the engine returned {got} log-probs for {n} tokens")
        logprobs = [0.0 if lp is None else float(lp) for lp in self.logprobs]
        versions = [v if isinstance(v, int) and not isinstance(v, bool) else -1 for v in self.weight_versions]
        return logprobs, versions

    @classmethod
    def from_response(cls, obj: Any, rid: str | None = None) -> "GenerationResult":
        """Read one element of a ``/generate`` response (SGLang's format; the one reader of it).

        Per-token weight versions: ``meta_info.output_token_weight_versions`` (one per token),
        else the ``weight_versions`` spans ``[{"version", "start", "end"}]`` over
        ``weight_version``, else ``weight_version`` for every token. An answer without
        ``meta_info`` or ``output_ids`` is an :class:`EngineProtocolError`.
        """
        if not isinstance(obj, Mapping) or not isinstance(obj.get("meta_info"), Mapping):
            raise EngineProtocolError("returned an unexpected /generate body")
        if not isinstance(obj.get("output_ids"), list):
            raise EngineProtocolError("did not return output_ids")
        meta = dict(obj["meta_info"])
        output_ids = [int(t) for t in obj["output_ids"]]
        n = len(output_ids)
        finish = meta.get("finish_reason")
        if isinstance(finish, Mapping):
            detail = dict(finish)
            kind = str(finish.get("type") or "")
        else:  # no finish reason: the request is still streaming or the engine omitted it
            detail, kind = {}, str(finish or "")
        lp_triples = meta.get("output_token_logprobs")
        logprobs = None
        if lp_triples is not None:
            logprobs = [None if e is None or e[0] is None else float(e[0]) for e in lp_triples]
        top = meta.get("output_top_logprobs")
        top_logprobs = None
        if isinstance(top, list) and len(top) == n:
            top_logprobs = [[(float(e[0]), int(e[1])) for e in (row or []) if e and e[0] is not None] for row in top]
        version = as_version(meta.get("weight_version"))
        versions: list[int | str | None] = [version] * n
        per_token, spans = meta.get("output_token_weight_versions"), meta.get("weight_versions")
        if isinstance(per_token, list) and len(per_token) == n:
            versions = [as_version(v) for v in per_token]
        elif isinstance(spans, list) and spans and all(isinstance(span, Mapping) for span in spans):
            for span in spans:
                start, end = max(0, int(span.get("start", 0))), min(n, int(span.get("end", n)))
                versions[start:end] = [as_version(span.get("version"))] * max(0, end - start)
        cached = meta.get("cached_tokens")
        routed = meta.pop("routed_experts", None)
        routes = None
        if isinstance(routed, str) and routed:
            positions = int(meta.get("prompt_tokens") or 0) + n - 1
            try:
                routes = RoutedExperts.from_sglang(routed, positions, str(meta.get("routed_experts_dtype") or "int32"))
            except ValueError as exc:
                raise EngineProtocolError(f"returned unreadable routed_experts: {exc}") from None
        return cls(rid=str(meta.get("id") or rid or ""), output_ids=output_ids, logprobs=logprobs,
                   finish_reason=kind, finish_detail=detail, weight_version=version, weight_versions=versions,
                   prompt_tokens=int(meta.get("prompt_tokens") or 0),
                   cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) else 0,
                   text=str(obj.get("text") or ""), meta_info=meta, top_logprobs=top_logprobs, routed_experts=routes)


SPECULATION_KEYS = {"verify_forwards": "spec_verify_ct", "draft_tokens": "spec_draft_tokens",
                    "accepted_tokens": "spec_accepted_tokens", "emitted_tokens": "spec_emitted_tokens"}
"""A speculative-decoding engine's counters in ``meta_info`` (``spec_verify_ct`` is SGLang's name:
the request's verify forwards) by the names trajectories record them under."""


def speculation_counts(meta: Mapping[str, Any]) -> dict[str, int] | None:
    """What speculative decoding did for one answer: verify forwards, drafted, accepted and emitted
    tokens (``None`` when the engine reports no speculation; emitted falls back to the completion
    tokens, accepted/drafted to 0, for an engine that reports the forwards only)."""
    verify = meta.get("spec_verify_ct")
    if not isinstance(verify, int) or isinstance(verify, bool):
        return None
    out = {}
    for name, key in SPECULATION_KEYS.items():
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            value = int(meta.get("completion_tokens") or 0) if name == "emitted_tokens" else 0
        out[name] = value
    return out


def merge_stream_chunk(prev: GenerationResult | None, data: Any) -> GenerationResult:
    """Fold one streamed ``/generate`` chunk into the generation so far (``prev``).

    SGLang streams cumulative ``output_ids`` and log-probs by default and increments with
    ``--incremental-streaming-output``; ``meta_info.completion_tokens`` (the total so far) tells
    which, so both work. ``finish_reason`` is ``""`` until the last chunk.
    """
    if prev is not None and isinstance(data, Mapping) and isinstance(data.get("meta_info"), Mapping):
        meta = data["meta_info"]
        total, ids = meta.get("completion_tokens"), data.get("output_ids")
        if isinstance(ids, list) and isinstance(total, int) and total > len(ids) \
                and total == len(prev.output_ids) + len(ids):  # an increment: make it cumulative
            earlier = [[lp, t] for lp, t in zip(prev.logprobs or [], prev.output_ids)]
            merged = {**meta, "output_token_logprobs": earlier + list(meta.get("output_token_logprobs") or [])}
            if prev.top_logprobs is not None and isinstance(meta.get("output_top_logprobs"), list):
                merged["output_top_logprobs"] = ([[[lp, t] for lp, t in row] for row in prev.top_logprobs]
                                                 + meta["output_top_logprobs"])
            data = {**data, "output_ids": prev.output_ids + ids, "meta_info": merged}
    return GenerationResult.from_response(data)


def check_response(resp: httpx.Response, path: str) -> httpx.Response:
    """``resp`` when its status is below 400; else the :class:`EngineError` carrying the engine's
    own message (``error.message``, ``error`` or ``message`` of a JSON body, else the text)."""
    if resp.status_code < 400:
        return resp
    message, param = resp.text.strip(), None
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping):
            message = str(err.get("message") or message)
            param = err.get("param")
        elif isinstance(err, str):
            message = err
        elif body.get("message"):
            message = str(body["message"])
    raise EngineError(resp.status_code, message or resp.reason_phrase, path, param)


def json_or_text(resp: httpx.Response) -> Any:
    """The JSON body of ``resp`` (``{}`` when empty; ``{"message": text}`` when it is not JSON)."""
    if not resp.content:
        return {}
    try:
        return resp.json()
    except ValueError:
        return {"message": resp.text}
