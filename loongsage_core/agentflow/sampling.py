"""The router's sampling policy: what one turn may generate and with which sampling parameters.

A trajectory is registered with sampling defaults (:class:`~.record.SamplingDefaults`, SGLang
names); a request's own values win unless the defaults are ``locked`` (a training run samples
the policy with the job's settings whatever the agent asks for). How many tokens a turn may
generate is the smallest of: what the request (or the defaults) asks, what is left of the
trajectory's response budget, what the segment's context limit leaves and what the engine's
context length leaves. A prompt that leaves no room at all is a 400 ``context_length_exceeded``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from loongsage_hookspecs import SamplingParams, TrajectoryStatus

from .errors import bad_request
from .openai_api import ChatRequest
from .record import SamplingDefaults, TrajectoryRecord

SEED_STRIDE = 0x9E3779B1
"""Added to a registered seed per turn, so the turns of one trajectory do not share a random stream."""


def engine_sampling(defaults: SamplingDefaults, req: ChatRequest, turn: int, turn_end_ids: Sequence[int],
                    max_new: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` for turn ``turn``: request values over the registered defaults.

    The registered seed is varied per turn (turn 0 uses it as is); a seed the request sets is
    used unchanged. Stop strings go to the engine; the turn-end tokens always stop.
    """
    d = defaults

    def pick(value: Any, default: Any) -> Any:
        return default if value is None or d.locked else value

    seed = pick(req.seed, None)
    if seed is None and d.seed is not None:
        seed = (d.seed + turn * SEED_STRIDE) % 2**31

    params = SamplingParams(
        temperature=float(pick(req.temperature, d.temperature)),
        top_p=float(pick(req.top_p, d.top_p)),
        top_k=int(pick(req.top_k, d.top_k)),
        max_new_tokens=max_new,
        stop_token_ids=list(dict.fromkeys([*turn_end_ids, *d.stop_token_ids])),
        seed=seed,
    ).to_sglang()
    params.update(d.extra)
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not d.locked:
            params[name] = value
    if req.stop:
        params["stop"] = list(req.stop)
    return params


def sampling_used(defaults: SamplingDefaults, req: ChatRequest) -> dict[str, float]:
    """The values of ``temperature``, ``top_p``, ``presence_penalty`` and ``frequency_penalty``
    a turn is sampled with (what :func:`engine_sampling` sends; an engine's neutral 0 for a
    penalty nobody set), for protocols that report them (the Responses API)."""
    d = defaults

    def pick(value: Any, default: Any) -> float:
        return float(default if value is None or d.locked else value)

    return {"temperature": pick(req.temperature, d.temperature), "top_p": pick(req.top_p, d.top_p),
            "presence_penalty": pick(req.presence_penalty, d.extra.get("presence_penalty", 0.0)),
            "frequency_penalty": pick(req.frequency_penalty, d.extra.get("frequency_penalty", 0.0))}


def max_new_tokens(defaults: SamplingDefaults, record: TrajectoryRecord, req: ChatRequest, context_tokens: int,
                   engine_ctx: int | None) -> int:
    """How many tokens this turn may generate (0: a budget is spent, the turn ends at once)."""
    d = defaults
    wanted = d.max_new_tokens if req.max_tokens is None else (
        min(req.max_tokens, d.max_new_tokens) if d.locked else req.max_tokens)
    if record.max_response_tokens is not None:
        wanted = min(wanted, record.max_response_tokens - record.response_tokens)
    if record.max_context_length is not None:
        wanted = min(wanted, record.max_context_length - context_tokens)
    if engine_ctx is not None:
        wanted = min(wanted, engine_ctx - context_tokens - 1)  # the engine needs one position beyond the prompt
    return max(0, wanted)


def check_context_room(record: TrajectoryRecord, context_tokens: int, engine_ctx: int | None) -> None:
    """A prompt that leaves no room to generate is a 400 ``context_length_exceeded``; the
    trajectory is marked failed (its agent cannot go on as it is)."""
    # the same room max_new_tokens computes: the engine needs one position beyond the prompt
    limits = [n for n in (record.max_context_length, None if engine_ctx is None else engine_ctx - 1) if n is not None]
    if not limits or context_tokens < min(limits):
        return
    limit = min(limits)
    if engine_ctx is not None and limit == engine_ctx - 1:
        limit = engine_ctx
    message = (f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
               f"{context_tokens} tokens. Please reduce the length of the messages.")
    record.status = TrajectoryStatus.FAILED
    record.error = f"context_length_exceeded: {message}"
    record.finish_reason = "context_length_exceeded"
    raise bad_request(message, param="messages", code="context_length_exceeded")


def check_prompt_size(messages: Sequence[Mapping[str, Any]], tools: Any, max_chars: int) -> None:
    """Refuse (400) a conversation whose text exceeds ``max_chars``, before rendering it.

    Counts every string in the messages (content, tool-call arguments, names) and the tool
    schemas as JSON.
    """
    total = len(json.dumps(tools, ensure_ascii=False, default=str)) if tools else 0

    def count(value: Any) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, Mapping):
            return sum(count(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(count(v) for v in value)
        return 0

    for message in messages:
        total += count(message)
        if total > max_chars:
            break
    if total > max_chars:
        raise bad_request(f"the conversation has more than {max_chars} characters of text "
                          "([agentflow] max_prompt_chars); shorten or compact it", param="messages",
                          code="prompt_too_long")
