"""The JSON the embedded engine answers ``/generate`` with, in SGLang's shapes.

:func:`response_body` builds one answer (``text``, ``output_ids``, ``meta_info``; the fields are
listed in :mod:`.server`) from a :class:`~.request_state.GenerationResult`; the helpers below
write SGLang's ``weight_versions`` spans and log-prob rows (the batching loop writes
``finish_reason`` with :func:`~.request_state.finish_json`). Kept apart from the server so that
the routes read without the JSON details.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Sequence

from .prompt_logprobs import input_logprob_fields

if TYPE_CHECKING:  # pragma: no cover
    from .http_common import ServedEngine
    from .request_state import GenerationResult


def top_logprob_rows(rows: Sequence[Sequence[tuple[float, int]]]) -> list[list[list[Any]]]:
    """SGLang's ``output_top_logprobs``: per output token ``[[logprob, token_id, null], ...]``."""
    return [[[lp, t, None] for lp, t in row] for row in rows]


def token_logprob_triples(logprobs: Sequence[float], tokens: Sequence[int],
                          texts: Sequence[str | None] | None = None) -> list[list[Any]]:
    """SGLang's ``output_token_logprobs``: ``[[logprob, token_id, text_or_null], ...]``."""
    if texts is None:
        return [[lp, t, None] for lp, t in zip(logprobs, tokens)]
    return [[lp, t, s] for lp, t, s in zip(logprobs, tokens, texts)]


def weight_version_spans(versions: list[int]) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions``: runs of equal versions over the output tokens."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def response_body(engine: "ServedEngine", item: Any, res: "GenerationResult") -> dict[str, Any]:
    """One ``/generate`` answer (or streamed event) for ``item``: ``text`` (decoded, the matched stop
    string trimmed unless ``no_stop_trim``), ``output_ids`` and ``meta_info``."""
    params = item.params
    meta: dict[str, Any] = {
        "id": res.rid,
        "finish_reason": res.finish_reason or None,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(res.output_ids),
        "cached_tokens": res.cached_tokens,
        "e2e_latency": res.latency_s,
        "weight_version": str(res.weight_version),
        "weight_versions": weight_version_spans(res.weight_versions),
        "output_token_weight_versions": res.weight_versions,
    }
    if res.speculative is not None:  # SGLang's spec_verify_ct, and what the drafts did
        meta["spec_verify_ct"] = res.speculative["verify_forwards"]
        meta["spec_draft_tokens"] = res.speculative["draft_tokens"]
        meta["spec_accepted_tokens"] = res.speculative["accepted_tokens"]
        meta["spec_emitted_tokens"] = res.speculative["emitted_tokens"]
    if item.return_logprob:
        texts = None
        if item.return_text_in_logprobs and engine.tokenizer is not None:
            texts = [engine.decode([t], skip_special_tokens=False) for t in res.output_ids]
        meta["output_token_logprobs"] = token_logprob_triples(res.logprobs, res.output_ids, texts)
        if res.top_logprobs is not None:
            meta["output_top_logprobs"] = top_logprob_rows(res.top_logprobs)
        decode_one = None
        if item.return_text_in_logprobs and engine.tokenizer is not None:
            def decode_one(t: int) -> str:
                return engine.decode([t], skip_special_tokens=False)
        meta.update(input_logprob_fields(item, res, decode_one))
    if res.routed_experts is not None:  # SGLang: base64 of int32 [positions, layers, top_k], row-major
        meta["routed_experts"] = base64.b64encode(res.routed_experts.astype("<i4").tobytes()).decode("ascii")
        meta["routed_experts_dtype"] = "int32"
    text = engine.decode(res.output_ids, skip_special_tokens=params.skip_special_tokens)
    matched = res.finish_reason.get("matched") if res.finish_reason else None
    if isinstance(matched, str) and not params.no_stop_trim:  # SGLang trims the stop string
        at = text.rfind(matched)
        text = text[:at] if at >= 0 else text
    return {"text": text, "output_ids": res.output_ids, "meta_info": meta}
