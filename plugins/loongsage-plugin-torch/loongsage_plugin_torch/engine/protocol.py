"""Validation of the SGLang-native ``/generate`` body the embedded engine accepts.

The field names are SGLang's (``GenerateReqInput`` and its ``sampling_params``). Fields the
engine implements are checked for type and range; SGLang fields it does not implement are
accepted only at their neutral default; anything else is rejected. Every problem raises
:class:`~.request_checks.InvalidRequest` naming the field, which the server turns into HTTP 400
with ``{"error": {"message", "type": "invalid_request_error", "param"}}``.

The control endpoints' bodies (abort, pause, weight updates, memory) are validated in
:mod:`.control_protocol`; the shared error and readers live in :mod:`.request_checks`.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Mapping, Sequence

import attrs

from .request_checks import (
    InvalidRequest,
    check_unknown,
    is_empty,
    is_int,
    is_none,
    is_none_or_false,
    is_number,
    read_bool,
    require_object,
)
from .sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens`` (clipped to the room left in the context when defaulted)."""


@attrs.define
class GenerateItem:
    """One validated request of a ``/generate`` body (a batch body yields several)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    return_text_in_logprobs: bool = False
    parent_rid: str | None = None
    top_logprobs_num: int = 0
    stream: bool = False
    lora_path: str | None = None
    return_routed_experts: bool = False
    image_data: tuple[str, ...] = ()
    """The prompt's images in token order (base64), for a vision-language model."""
    vision: Any = None
    """The images prepared for the model (:class:`~.vision.VisionInputs`), set by the server."""
    logprob_start_len: int = -1
    """SGLang's ``logprob_start_len``: with ``return_logprob``, the log-probs of the prompt's tokens
    from this position on are returned too (``input_token_logprobs``); -1: output tokens only."""
    priority: int = 0
    """SGLang's request ``priority``: a larger value is admitted sooner (unset: 0)."""


# --------------------------------------------------------------------------------------------
# /generate
# --------------------------------------------------------------------------------------------

GENERATE_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream",
                   "return_text_in_logprobs", "logprob_start_len", "top_logprobs_num", "lora_path",
                   "return_routed_experts", "image_data", "priority"}
GENERATE_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "log_metrics": lambda v: isinstance(v, bool) or v is None,
    # fields sglang-router adds to every request it forwards
    "model": lambda v: v is None or isinstance(v, str),
    "background": lambda v: v is None or v is False,
    "return_bytes": lambda v: v is None or v is False,
    "custom_labels": lambda v: v is None or isinstance(v, dict),
    "routing_key": lambda v: v is None or isinstance(v, str),
    "conversation_id": lambda v: v is None or isinstance(v, str),
    "session_id": lambda v: v is None or isinstance(v, str),
    "no_logs": lambda v: isinstance(v, bool) or v is None,
    "input_embeds": is_none, "video_data": is_none, "audio_data": is_none,
    "token_ids_logprob": is_none, "return_hidden_states": is_none_or_false, "return_routed_experts": is_none_or_false,
    "return_entropy": is_none_or_false, "lora_id": is_none, "session_params": is_none,
    "custom_logit_processor": is_none, "modalities": is_none, "bootstrap_host": is_none,
    "bootstrap_port": is_none, "bootstrap_room": is_none, "data_parallel_rank": is_none,
    "routed_dp_rank": is_none, "extra_key": is_none, "return_prompt_token_ids": is_none_or_false,
}

SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids",
                   "ignore_eos", "sampling_seed", "seed", "skip_special_tokens", "n", "stop", "no_stop_trim",
                   "json_schema", "regex", "ebnf", "custom_params"}
SAMPLING_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "spaces_between_special_tokens": lambda v: isinstance(v, bool) or v is None,
    "stream_interval": lambda v: v is None or is_int(v),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "min_new_tokens": lambda v: v in (None, 0),
    "stop_regex": is_empty, "structural_tag": is_none, "logit_bias": is_empty,
}


def parse_sampling_params(raw: Any, *, where: str, vocab_size: int, prompt_len: int,
                          max_context: int, can_decode: bool = True) -> SamplingParams:
    """Validate one ``sampling_params`` object for a prompt of ``prompt_len`` tokens."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise InvalidRequest(f"'{where}' must be an object, got {type(raw).__name__}", where)
    w = where + "."
    check_unknown(raw, SAMPLING_FIELDS, SAMPLING_NEUTRAL, w)

    def number(key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
        v = raw.get(key)
        if v is None:
            return default
        if not is_number(v) or v != v:
            raise InvalidRequest(f"'{w}{key}' must be a number, got {v!r}", w + key)
        if v < lo or v > hi or (lo_open and v == lo):
            bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise InvalidRequest(f"'{w}{key}' must be in {bound}, got {v!r}", w + key)
        return float(v)

    temperature = number("temperature", 1.0, 0.0, float("inf"))
    top_p = number("top_p", 1.0, 0.0, 1.0, lo_open=True)
    min_p = number("min_p", 0.0, 0.0, 1.0)
    top_k = raw.get("top_k")
    if top_k is None:
        top_k = -1
    if not is_int(top_k) or (top_k != -1 and top_k < 1):
        raise InvalidRequest(f"'{w}top_k' must be -1 (disabled) or an integer >= 1, got {top_k!r}", w + "top_k")
    n = raw.get("n")
    if n not in (None, 1):
        raise InvalidRequest(f"'{w}n' = {n!r} is not supported: send the prompt once per sample in a batch",
                             w + "n")
    stop = raw.get("stop")
    stops: list[str] = []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        stops = list(stop)
    elif stop is not None:
        raise InvalidRequest(f"'{w}stop' must be a string or a list of strings, got {stop!r}", w + "stop")
    if any(not x for x in stops):
        raise InvalidRequest(f"'{w}stop' strings must be non-empty", w + "stop")
    if stops and not can_decode:
        raise InvalidRequest(f"'{w}stop' (stop strings) needs a tokenizer, and this engine has none; "
                             "use 'stop_token_ids'", w + "stop")
    stop_ids = raw.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(is_int(t) and 0 <= t < vocab_size for t in stop_ids):
        raise InvalidRequest(f"'{w}stop_token_ids' must be a list of token ids in [0, {vocab_size}), "
                             f"got {stop_ids!r}", w + "stop_token_ids")
    seed = raw.get("sampling_seed", raw.get("seed"))
    seed_key = "sampling_seed" if "sampling_seed" in raw else "seed"
    if seed is not None and not is_int(seed):
        raise InvalidRequest(f"'{w}{seed_key}' must be an integer, got {seed!r}", w + seed_key)
    if seed is not None and not -(2**63) <= seed < 2**64:  # what torch.Generator.manual_seed takes
        raise InvalidRequest(f"'{w}{seed_key}' must be in [-2**63, 2**64), got {seed}", w + seed_key)
    room = max_context - prompt_len
    max_new = raw.get("max_new_tokens")
    if max_new is None:
        max_new = max(0, min(DEFAULT_MAX_NEW_TOKENS, room))
    elif not is_int(max_new) or max_new < 0:
        raise InvalidRequest(f"'{w}max_new_tokens' must be a non-negative integer, got {max_new!r}",
                             w + "max_new_tokens")
    elif max_new > room:
        raise InvalidRequest(
            f"'{w}max_new_tokens' = {max_new} does not fit: the prompt has {prompt_len} tokens and the "
            f"context length is {max_context}, so at most {max(room, 0)} new tokens are possible",
            w + "max_new_tokens")
    grammar, grammar_offset = _read_constraint(raw, w, prompt_len)
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_new_tokens=max_new,
        stop_token_ids=tuple(stop_ids), ignore_eos=read_bool(raw, "ignore_eos", False, w), seed=seed,
        skip_special_tokens=read_bool(raw, "skip_special_tokens", True, w), stop=tuple(stops),
        no_stop_trim=read_bool(raw, "no_stop_trim", False, w), grammar=grammar, grammar_offset=grammar_offset)


def _read_constraint(raw: Mapping[str, Any], w: str, prompt_len: int) -> tuple[str | None, int]:
    """The request's grammar (SGLang's ``json_schema``, ``regex`` or ``ebnf``, at most one; see
    :mod:`loongsage_core.backend_api.grammar`) and ``custom_params.grammar_offset``: how many of
    the prompt's last tokens were already generated under it (a turn resumed after an abort)."""
    from loongsage_core.backend_api.grammar import KINDS, GrammarError, compile_grammar

    given = [k for k in KINDS if raw.get(k) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"only one of '{w}json_schema', '{w}regex' and '{w}ebnf' may be set, got "
                             f"{', '.join(repr(w + k) for k in given)}", w + given[1])
    custom = raw.get("custom_params")
    if custom is not None and not isinstance(custom, Mapping):
        raise InvalidRequest(f"'{w}custom_params' must be an object, got {custom!r}", w + "custom_params")
    unknown = sorted(set(custom or {}) - {"grammar_offset"})
    if unknown:
        raise InvalidRequest(f"'{w}custom_params.{unknown[0]}' is not supported (only 'grammar_offset')",
                             f"{w}custom_params.{unknown[0]}")
    offset = (custom or {}).get("grammar_offset", 0)
    if not is_int(offset) or not 0 <= offset < prompt_len:
        raise InvalidRequest(f"'{w}custom_params.grammar_offset' must be an integer in [0, {prompt_len}), "
                             f"got {offset!r}", w + "custom_params.grammar_offset")
    if not given:
        if offset:
            raise InvalidRequest(f"'{w}custom_params.grammar_offset' needs a constraint ('{w}json_schema', "
                                 f"'{w}regex' or '{w}ebnf')", w + "custom_params.grammar_offset")
        return None, 0
    kind = given[0]
    try:
        return compile_grammar(kind, raw[kind]), int(offset)
    except GrammarError as exc:
        raise InvalidRequest(f"'{w}{kind}': {exc}", w + kind) from None


def _token_list(value: Any, where: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise InvalidRequest(f"'{where}' must be a list of token ids, got {type(value).__name__}", where)
    if not value:
        raise InvalidRequest(f"'{where}' is empty: a prompt needs at least one token", where)
    for t in value:
        if not is_int(t):
            raise InvalidRequest(f"'{where}' must contain integers, got {t!r}", where)
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"'{where}' has token id {t} outside the vocabulary [0, {vocab_size})", where)
    return value


def _per_item(value: Any, count: int, key: str) -> list[Any]:
    """A batch field may be one value for all items or a list with one value per item."""
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidRequest(f"'{key}' has {len(value)} entries for a batch of {count}", key)
        return value
    return [value] * count


def _read_lora_paths(value: Any, count: int, adapters: Sequence[str]) -> list[str | None]:
    """Each item's ``lora_path`` (SGLang: an adapter name per request, or one for all), which must
    be unset or name an adapter the engine serves (the embedded engine: the trained one)."""
    names = _per_item(value, count, "lora_path")
    for i, name in enumerate(names):
        if name is None:
            continue
        key = "lora_path" if not isinstance(value, list) else f"lora_path[{i}]"
        if not isinstance(name, str):
            raise InvalidRequest(f"'{key}' must be an adapter name (a string), got {name!r}", key)
        if name not in adapters:
            served = (f"it serves {', '.join(repr(a) for a in adapters)}" if adapters
                      else "it serves none: the job sets no [train] lora")
            raise InvalidRequest(f"'{key}' = {name!r} names no LoRA adapter of this engine ({served})", key)
    return names


def parse_generate(body: Any, *, vocab_size: int, max_context: int, encode: Callable[[str], list[int]] | None,
                   can_decode: bool = True, adapters: Sequence[str] = (),
                   routes_experts: bool = False, takes_images: bool = False) -> tuple[list[GenerateItem], bool]:
    """Validate a ``/generate`` body; returns the items and whether the input was a single prompt.

    ``adapters``: the LoRA adapter names a request's ``lora_path`` may give; ``routes_experts``:
    the model has mixture-of-experts layers, so ``return_routed_experts`` may be asked;
    ``takes_images``: the model is a vision-language model, so ``image_data`` may be sent."""
    body = require_object(body, "/generate")
    check_unknown(body, GENERATE_FIELDS, GENERATE_NEUTRAL)
    stream = read_bool(body, "stream", False, "")
    top_n = body.get("top_logprobs_num")
    if top_n is None:
        top_n = 0
    if not is_int(top_n) or not 0 <= top_n <= min(vocab_size, 1000):
        raise InvalidRequest(f"'top_logprobs_num' must be an integer in [0, {min(vocab_size, 1000)}], got {top_n!r}",
                             "top_logprobs_num")
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None and text is not None:
        raise InvalidRequest("send either 'input_ids' or 'text', not both", "input_ids")
    if ids is None and text is None:
        raise InvalidRequest("'input_ids' is required", "input_ids")
    if ids is None:
        if encode is None:
            raise InvalidRequest("'text' needs a tokenizer, and this engine has none configured; send 'input_ids'",
                                 "text")
        if isinstance(text, str):
            ids, single = [encode(text)], True
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            ids, single = [encode(t) for t in text], False
        else:
            raise InvalidRequest("'text' must be a string or a non-empty list of strings", "text")
        prompts = [_token_list(p, "text" if single else f"text[{i}]", vocab_size) for i, p in enumerate(ids)]
    else:
        if not isinstance(ids, list) or not ids:
            raise InvalidRequest("'input_ids' must be a non-empty list of token ids or of token-id lists", "input_ids")
        single = not isinstance(ids[0], list)
        if single:
            prompts = [_token_list(ids, "input_ids", vocab_size)]
        else:
            prompts = [_token_list(p, f"input_ids[{i}]", vocab_size) for i, p in enumerate(ids)]
    count = len(prompts)
    if stream and count != 1:
        raise InvalidRequest("'stream' = true needs a single prompt, not a batch", "stream")

    rid = body.get("rid")
    if single:
        if rid is not None and not isinstance(rid, str):
            raise InvalidRequest(f"'rid' must be a string for a single prompt, got {rid!r}", "rid")
        rids, parent = [rid or uuid.uuid4().hex], None
    elif rid is None:
        rids, parent = [uuid.uuid4().hex for _ in range(count)], None
    elif isinstance(rid, str):
        rids, parent = [f"{rid}_{i}" for i in range(count)], rid
    elif isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) and r for r in rid):
        rids, parent = list(rid), None
    else:
        raise InvalidRequest(f"'rid' must be a string or a list of {count} non-empty strings", "rid")
    if len(set(rids)) != len(rids):
        raise InvalidRequest("'rid' has duplicate request ids in one batch", "rid")

    sp = body.get("sampling_params")
    sps = sp if isinstance(sp, list) else [sp] * count
    if len(sps) != count:
        raise InvalidRequest(f"'sampling_params' has {len(sps)} entries for a batch of {count}", "sampling_params")
    rl = _per_item(body.get("return_logprob"), count, "return_logprob")
    routed = _per_item(body.get("return_routed_experts", False), count, "return_routed_experts")
    if not all(isinstance(flag, bool) for flag in routed):
        raise InvalidRequest("'return_routed_experts' must be a boolean or a list of booleans", "return_routed_experts")
    if any(routed) and not routes_experts:
        raise InvalidRequest("'return_routed_experts': the served model has no mixture-of-experts layers",
                             "return_routed_experts")
    lora_paths = _read_lora_paths(body.get("lora_path"), count, adapters)
    starts = _per_item(body.get("logprob_start_len"), count, "logprob_start_len")
    images = _read_image_data(body.get("image_data"), count, single, takes_images)
    priority = body.get("priority")
    if priority is None:
        priority = 0
    elif not is_int(priority):
        raise InvalidRequest(f"'priority' must be an integer, got {priority!r}", "priority")
    items = []
    for i, prompt in enumerate(prompts):
        where_ids = "input_ids" if single else f"input_ids[{i}]"
        if len(prompt) >= max_context:
            raise InvalidRequest(f"'{where_ids}' has {len(prompt)} tokens, which does not fit the context "
                                 f"length of {max_context} tokens", where_ids)
        where_sp = "sampling_params" if not isinstance(sp, list) else f"sampling_params[{i}]"
        params = parse_sampling_params(sps[i], where=where_sp, vocab_size=vocab_size,
                                       prompt_len=len(prompt), max_context=max_context, can_decode=can_decode)
        ret_lp = rl[i]
        if ret_lp is None:
            ret_lp = False
        if not isinstance(ret_lp, bool):
            raise InvalidRequest(f"'return_logprob' must be a boolean, got {ret_lp!r}", "return_logprob")
        start = _logprob_start(starts[i], len(prompt), "logprob_start_len" if single else f"logprob_start_len[{i}]")
        items.append(GenerateItem(rid=rids[i], input_ids=list(prompt), params=params, return_logprob=ret_lp,
                                  return_text_in_logprobs=read_bool(body, "return_text_in_logprobs", False, ""),
                                  parent_rid=parent, top_logprobs_num=top_n, stream=stream,
                                  lora_path=lora_paths[i], return_routed_experts=routed[i],
                                  image_data=images[i], logprob_start_len=start, priority=priority))
    return items, single


def _logprob_start(value: Any, prompt_len: int, where: str) -> int:
    """One item's ``logprob_start_len``: -1 (or unset) for output-token log-probs only, else the
    first prompt position whose token's log-prob is returned (0 .. prompt length - 1)."""
    if value is None:
        return -1
    if not is_int(value) or not -1 <= value < prompt_len:
        raise InvalidRequest(f"'{where}' must be -1 (output tokens only) or a prompt position in "
                             f"[0, {prompt_len - 1}], got {value!r}", where)
    return int(value)


def _read_image_data(value: Any, count: int, single: bool, takes_images: bool) -> list[tuple[str, ...]]:
    """Each item's images: SGLang's ``image_data``, a list of base64 strings for a single prompt
    or one such list (or ``null``) per prompt of a batch."""
    empty: tuple[str, ...] = ()
    if value is None or value == []:
        return [empty] * count
    if not takes_images:
        raise InvalidRequest("'image_data': the served model takes no images (not a vision-language model)",
                             "image_data")
    rows = [value] if single else value
    if not isinstance(rows, list) or len(rows) != count:
        raise InvalidRequest(f"'image_data' must be a list of images (one list per prompt of a batch of {count})",
                             "image_data")
    out: list[tuple[str, ...]] = []
    for i, row in enumerate(rows):
        where = "image_data" if single else f"image_data[{i}]"
        if row is None:
            out.append(empty)
            continue
        if not isinstance(row, list) or not all(isinstance(x, str) for x in row):
            raise InvalidRequest(f"'{where}' must be a list of base64 strings", where)
        out.append(tuple(row))
    return out
