"""Validation of the SGLang-native bodies of the embedded engine's control endpoints.

The field names are SGLang's (``AbortReq``, ``PauseGenerationReqInput``,
``UpdateWeightsFromTensorReqInput``, ``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``UpdateWeightFromDiskReqInput``,
``UpdateWeightVersionReqInput``, the memory occupation requests), checked as :mod:`.protocol`
checks ``/generate``: every problem raises :class:`~.request_checks.InvalidRequest` naming the
field. Kept apart from ``/generate`` because these bodies are what the trainer side sends between
rollouts, not what rollouts send.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from loongsage_hookspecs import parse_weight_version

from .request_checks import InvalidRequest, check_unknown, is_empty, is_int, is_none_or_false, read_bool, require_object

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory tags for ``/release_memory_occupation`` and ``/resume_memory_occupation``."""


def parse_abort(body: Any) -> tuple[str | None, bool]:
    """``/abort_request``: ``(rid or None, abort_all)``."""
    body = require_object(body if body is not None else {}, "/abort_request")
    check_unknown(body, {"rid", "abort_all", "finished_reason", "abort_message"}, {})
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequest(f"'rid' must be a string, got {rid!r}", "rid")
    abort_all = read_bool(body, "abort_all", False, "")
    if not abort_all and not rid:
        raise InvalidRequest("give a 'rid' to abort or set 'abort_all' to true", "rid")
    return rid or None, abort_all


PAUSE_MODES = ("abort", "retract", "in_place")


def parse_pause(body: Any) -> str:
    """``/pause_generation``: the mode (SGLang's default is ``"abort"``)."""
    body = require_object(body if body is not None else {}, "/pause_generation")
    check_unknown(body, {"mode", "rid"}, {})
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise InvalidRequest(f"'mode' must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
    return mode


def parse_version(value: Any, field: str) -> int:
    """A weight version: LoongSage versions are integers (SGLang sends them as strings)."""
    version = parse_weight_version(value)
    if version is not None:
        return version
    raise InvalidRequest(f"'{field}' must be an integer weight version (or its decimal string), got {value!r}", field)


@attrs.define
class WeightUpdate:
    """A validated ``/update_weights_from_tensor`` body."""

    load_format: str
    payload: Mapping[str, Any]
    flush_cache: bool
    abort_all_requests: bool
    weight_version: int | None


def parse_update_weights(body: Any) -> WeightUpdate:
    body = require_object(body, "/update_weights_from_tensor")
    check_unknown(body, {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                          "weight_version", "rid"},
                   {"disable_draft_model": lambda v: v in (None, True, False),
                    "torch_empty_cache": lambda v: v in (None, True, False)})
    if "serialized_named_tensors" not in body:
        raise InvalidRequest("'serialized_named_tensors' is required", "serialized_named_tensors")
    fmt = body.get("load_format") or "direct"
    if not isinstance(fmt, str):
        raise InvalidRequest(f"'load_format' must be a string, got {fmt!r}", "load_format")
    version = body.get("weight_version")
    return WeightUpdate(load_format=fmt, payload=body, flush_cache=read_bool(body, "flush_cache", True, ""),
                        abort_all_requests=read_bool(body, "abort_all_requests", False, ""),
                        weight_version=None if version is None else parse_version(version, "weight_version"))


@attrs.define
class DiskUpdate:
    """A validated ``/update_weights_from_disk`` body (SGLang's ``UpdateWeightFromDiskReqInput``)."""

    model_path: str
    flush_cache: bool
    abort_all_requests: bool
    weight_version: int | None


def parse_update_from_disk(body: Any) -> DiskUpdate:
    """``/update_weights_from_disk``: ``model_path`` (a Hugging Face directory of the served
    model's architecture, on the engine's machine), ``load_format`` (``auto`` or ``safetensors``),
    ``weight_version``, ``flush_cache``, ``abort_all_requests``."""
    body = require_object(body, "/update_weights_from_disk")
    flag = lambda v: v in (None, True, False)  # noqa: E731
    check_unknown(body, {"model_path", "load_format", "flush_cache", "abort_all_requests", "weight_version"},
                  {"is_async": is_none_or_false, "torch_empty_cache": flag, "recapture_cuda_graph": flag,
                   "token_step": lambda v: v is None or is_int(v)})
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise InvalidRequest("'model_path' must name a Hugging Face directory", "model_path")
    fmt = body.get("load_format")
    if fmt not in (None, "auto", "safetensors"):
        raise InvalidRequest(f"'load_format' must be 'auto' or 'safetensors', got {fmt!r}", "load_format")
    version = body.get("weight_version")
    return DiskUpdate(model_path=path, flush_cache=read_bool(body, "flush_cache", True, ""),
                      abort_all_requests=read_bool(body, "abort_all_requests", False, ""),
                      weight_version=None if version is None else parse_version(version, "weight_version"))


@attrs.define
class GroupJoin:
    """A validated ``/init_weights_update_group`` body (SGLang's ``InitWeightsUpdateGroupReqInput``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


def parse_init_weights_group(body: Any) -> GroupJoin:
    body = require_object(body, "/init_weights_update_group")
    check_unknown(body, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
                          "rid"}, {})
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if key not in body:
            raise InvalidRequest(f"'{key}' is required", key)
    if not isinstance(body["master_address"], str) or not body["master_address"]:
        raise InvalidRequest(f"'master_address' must be a host name, got {body['master_address']!r}",
                             "master_address")
    for key, lo in (("master_port", 1), ("rank_offset", 1), ("world_size", 2)):
        if not is_int(body[key]) or body[key] < lo:
            raise InvalidRequest(f"'{key}' must be an integer >= {lo}, got {body[key]!r}", key)
    if body["rank_offset"] >= body["world_size"]:
        raise InvalidRequest(f"'rank_offset' {body['rank_offset']} must be below 'world_size' {body['world_size']} "
                             "(this engine is one rank of the group)", "rank_offset")
    backend = body.get("backend") or "nccl"
    if backend not in ("nccl", "gloo", "auto"):
        raise InvalidRequest(f"'backend' must be 'nccl', 'gloo' or 'auto', got {backend!r}", "backend")
    return GroupJoin(master_address=body["master_address"], master_port=body["master_port"],
                     rank_offset=body["rank_offset"], world_size=body["world_size"],
                     group_name=_group_name(body), backend=backend)


def _group_name(body: Mapping[str, Any]) -> str:
    name = body.get("group_name", "weight_update_group")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'group_name' must be a non-empty string, got {name!r}", "group_name")
    return name


def parse_destroy_weights_group(body: Any) -> str:
    """``/destroy_weights_update_group``: the group name."""
    body = require_object(body, "/destroy_weights_update_group")
    check_unknown(body, {"group_name", "rid"}, {})
    return _group_name(body)


def parse_update_distributed(body: Any) -> WeightUpdate:
    """``/update_weights_from_distributed``: SGLang's per-tensor lists, or a ``broadcast`` bucket."""
    body = require_object(body, "/update_weights_from_distributed")
    check_unknown(body, {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                          "weight_version", "load_format", "bucket", "rid"},
                   {"target_modules": is_empty, "free_kv_cache_before_recv": is_none_or_false})
    fmt = body.get("load_format")
    if fmt == "broadcast":
        if "bucket" not in body:
            raise InvalidRequest("'bucket' is required with load_format 'broadcast'", "bucket")
    elif fmt is None:
        lists = {}
        for key in ("names", "dtypes", "shapes"):
            value = body.get(key)
            if not isinstance(value, list):
                raise InvalidRequest(f"'{key}' must be a list (one entry per broadcast tensor), got {value!r}", key)
            lists[key] = value
        if not len(lists["names"]) == len(lists["dtypes"]) == len(lists["shapes"]):
            raise InvalidRequest(f"'names', 'dtypes' and 'shapes' must have equal lengths, got "
                                 f"{len(lists['names'])}, {len(lists['dtypes'])}, {len(lists['shapes'])}", "names")
        for i, shape in enumerate(lists["shapes"]):
            if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
                raise InvalidRequest(f"'shapes'[{i}] must be a list of non-negative integers, got {shape!r}", "shapes")
    else:
        raise InvalidRequest(f"'load_format' {fmt!r} is not supported here (omit it for per-tensor lists, or "
                             "'broadcast' for a flat bucket)", "load_format")
    version = body.get("weight_version")
    # the group named once, with SGLang's default, for the lock and the receiver alike
    return WeightUpdate(load_format=fmt or "per_tensor", payload={**body, "group_name": _group_name(body)},
                        flush_cache=read_bool(body, "flush_cache", True, ""),
                        abort_all_requests=read_bool(body, "abort_all_requests", False, ""),
                        weight_version=None if version is None else parse_version(version, "weight_version"))


def parse_memory_tags(body: Any, path: str, known: Sequence[str]) -> list[str]:
    """``/release_memory_occupation`` / ``/resume_memory_occupation``: the tags (all when omitted)."""
    body = require_object(body if body is not None else {}, path)
    check_unknown(body, {"tags", "rid"}, {})
    tags = body.get("tags")
    if tags is None:
        return list(known)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise InvalidRequest(f"'tags' must be a list of strings, got {tags!r}", "tags")
    unknown = sorted(set(tags) - set(known))
    if unknown:
        raise InvalidRequest(f"'tags' {unknown} are unknown; known tags: {', '.join(known)}", "tags")
    return tags


def parse_weights_by_name(body: Any) -> tuple[str, int]:
    """``/get_weights_by_name`` (SGLang's): ``(name, truncate_size)``; ``truncate_size`` defaults to 100."""
    body = require_object(body, "/get_weights_by_name")
    check_unknown(body, {"name", "truncate_size", "rid"}, {})
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("'name' must be a parameter name", "name")
    size = body.get("truncate_size", 100)
    if not is_int(size) or size < 0:
        raise InvalidRequest("'truncate_size' must be an integer >= 0", "truncate_size")
    return name, int(size)


def parse_update_version(body: Any) -> tuple[int, bool]:
    """``/update_weight_version``: ``(new_version, abort_all_requests)``."""
    body = require_object(body, "/update_weight_version")
    check_unknown(body, {"new_version", "abort_all_requests", "rid"}, {})
    if "new_version" not in body:
        raise InvalidRequest("'new_version' is required", "new_version")
    return parse_version(body["new_version"], "new_version"), read_bool(body, "abort_all_requests", True, "")
