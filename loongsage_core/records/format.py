"""The rollout record format (version 1): one JSON object per trajectory.

:func:`build_records` turns a step's trajectory groups and its training batch into records. Every
per-token list of a segment has the segment's length; the tensors of the batch row that trained
the segment (``loss_mask``, ``old_logprobs``, ``advantages``, ...) are copied as they were trained,
so a record shows exactly what the trainer saw. docs/reference/records.md documents every field; a change
that breaks a reader raises :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

FORMAT_VERSION = 1
"""Written into every record as ``"format"``; readers refuse records of a newer version."""

ROLLOUTS_DIR = "rollouts"
FILE_PREFIX = "step_"
FILE_SUFFIX = ".jsonl.gz"

ROW_TENSORS = ("loss_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages", "values", "returns")
"""Per-token tensors of a batch row copied into the record of the segment it trained."""

STATUSES = ("ok", "failed", "truncated", "aborted")


def records_path(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/rollouts/step_NNNNNN.jsonl.gz``: the records of ``step``."""
    return Path(run_dir) / ROLLOUTS_DIR / f"{FILE_PREFIX}{int(step):06d}{FILE_SUFFIX}"


def step_of(path: Path) -> int | None:
    """The step a records file name stands for, or ``None`` for any other file."""
    name = path.name
    if not (name.startswith(FILE_PREFIX) and name.endswith(FILE_SUFFIX)):
        return None
    digits = name[len(FILE_PREFIX):-len(FILE_SUFFIX)]
    return int(digits) if digits.isdigit() else None


def status_of(traj: Any) -> str:
    """``ok`` / ``truncated`` (completed, but ended by a length budget) / ``failed`` / ``aborted``."""
    status = getattr(traj.status, "value", traj.status)
    if status == "completed":
        return "truncated" if traj.finish_reason == "length" else "ok"
    if status == "aborted":
        return "aborted"
    return "failed"


def keep_indices(total: int, keep: int, seed: Any, step: int) -> list[int]:
    """Which of a step's ``total`` trajectories are recorded: all for ``keep < 0``, else ``keep`` of
    them drawn with a seed of the run and the step (the same after a resume)."""
    if keep < 0 or keep >= total:
        return list(range(total))
    return sorted(random.Random(f"{seed}:{step}:records").sample(range(total), keep))


def jsonable(value: Any) -> Any:
    """``value`` as JSON a browser can parse: non-finite floats become ``null``, unknown objects text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "value") and isinstance(value.value, str):  # enums
        return value.value
    return str(value)


def _floats(values: Sequence[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def tool_calls_of(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every tool call of the conversation with the output its tool returned (``None`` if none did).

    ``turn`` is the index of the assistant message that made the call among the assistant messages.
    """
    calls: list[dict[str, Any]] = []
    by_id: dict[str, dict[str, Any]] = {}
    turn = -1
    for m in messages:
        role = m.get("role")
        if role == "assistant":
            turn += 1
            for c in m.get("tool_calls") or []:
                fn = c.get("function") or {}
                call = {"turn": turn, "id": c.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments"),
                        "output": None}
                calls.append(call)
                if c.get("id"):
                    by_id[str(c["id"])] = call
        elif role == "tool":
            target = by_id.get(str(m.get("tool_call_id"))) if m.get("tool_call_id") is not None else None
            if target is None:  # no id: the first call still waiting for an output
                target = next((c for c in calls if c["output"] is None), None)
            if target is not None:
                target["output"] = m.get("content")
    return calls


def reward_record(reward: Any) -> dict[str, Any] | None:
    """The reward as a record: total score, reason, error, details and each component's own."""
    if reward is None:
        return None
    return {
        "score": float(reward.score),
        "reason": getattr(reward, "reason", "") or "",
        "error": reward.error,
        "details": jsonable(dict(reward.details)),
        "components": {name: {"score": float(c.score), "reason": getattr(c, "reason", "") or "",
                              "details": jsonable(dict(c.details)), "error": c.error}
                       for name, c in (getattr(reward, "components", None) or {}).items()},
    }


def _row_index(batch: Any) -> dict[tuple[str, int], int]:
    if batch is None or not len(batch):
        return {}
    meta = batch.meta
    return {(tid, int(seg)): i for i, (tid, seg) in enumerate(zip(meta["trajectory_id"], meta["segment"]))}


def _image_part(part: Any, images: Mapping[str, str]) -> Any:
    """A message content part as the records keep it: an image the trajectory stores (by the
    router's ``image`` part, or the agent's own ``image_url`` data URL of the same bytes) becomes
    ``{"type": "image", "sha256": ...}``, so its bytes are written once, in the record's ``images``."""
    if not isinstance(part, Mapping):
        return part
    if part.get("type") == "image" and part.get("sha256") in images:
        return {"type": "image", "sha256": part["sha256"]}
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, Mapping) else url
    if part.get("type") == "image_url" and isinstance(url, str) and url.startswith("data:") and "," in url:
        try:
            digest = hashlib.sha256(base64.b64decode(url.partition(",")[2], validate=True)).hexdigest()
        except (binascii.Error, ValueError):
            return part
        if digest in images:
            return {"type": "image", "sha256": digest}
    return part


def _messages_with_image_refs(messages: list[Any], images: Mapping[str, str]) -> list[Any]:
    """``messages`` with every stored image's parts replaced by a reference (:func:`_image_part`)."""
    if not images:
        return messages
    return [{**m, "content": [_image_part(p, images) for p in m["content"]]}
            if isinstance(m, Mapping) and isinstance(m.get("content"), list) else m for m in messages]


def _segment_record(seg: Any, row: int | None, token_text: Callable[[list[int]], list[str]],
                    row_lists: Mapping[str, Any]) -> dict[str, Any]:
    n = len(seg.tokens)
    out: dict[str, Any] = {"row": row, "tokens": list(seg.tokens), "token_text": token_text(list(seg.tokens)),
                           "loss_mask": list(seg.loss_mask), "rollout_logprobs": _floats(seg.logprobs),
                           "weight_versions": list(seg.weight_versions), "turns": [list(t) for t in seg.turns],
                           "parent": seg.parent, "fork_at": seg.fork_at}
    if seg.constraints:  # spans sampled under a grammar (constrained decoding)
        out["constraints"] = [{"start": c.start, "end": c.end, "grammar": c.grammar,
                               "stop_token_ids": list(c.stop_token_ids)} for c in seg.constraints]
    if getattr(seg, "images", None):  # a conversation with images: each image's hash and placeholder tokens
        out["images"] = [{"sha256": i.sha256, "start": i.start, "length": i.length} for i in seg.images]
    if row is not None:
        for name, rows in row_lists.items():
            out[name] = _floats(rows[row][:n]) if name != "loss_mask" else [int(x) for x in rows[row][:n]]
    return out


def _turn_order(segments: Sequence[Any], metadata: Any) -> list[tuple[int, int]]:
    """``(segment, turn within it)`` of every model turn in the order the turns were made: the
    order of the trajectory tree's ``turns`` lists (``metadata["agentflow"]["tree"]``) when they
    account for every turn, else segment by segment."""
    spans = [(s, k) for s, seg in enumerate(segments) for k in range(len(seg.turns))]
    tree = (metadata.get("agentflow") or {}).get("tree") if isinstance(metadata, Mapping) else None
    if not isinstance(tree, list) or len(tree) != len(segments):
        return spans
    made = {}
    for s, node in enumerate(tree):
        order = node.get("turns") if isinstance(node, Mapping) else None
        if not isinstance(order, list) or len(order) != len(segments[s].turns):
            return spans
        made.update({(s, k): n for k, n in enumerate(order)})
    if len(set(made.values())) != len(made):
        return spans
    return sorted(spans, key=made.__getitem__)


def _turns(segments: Sequence[Any], calls: Sequence[dict[str, Any]], decode: Callable[[list[int]], str],
           metadata: Any = None) -> list[dict[str, Any]]:
    """Model turns in the order they were made: the text the model read since the segment's
    previous turn, what it wrote, its calls."""
    turns: list[dict[str, Any]] = []
    for s_idx, k in _turn_order(segments, metadata):
        seg = segments[s_idx]
        prev = seg.turns[k - 1][1] if k else 0
        start, end = seg.turns[k]
        index = len(turns)
        turns.append({"segment": s_idx, "start": int(start), "end": int(end),
                      "prompt_text": decode(list(seg.tokens[prev:start])),
                      "response_text": decode(list(seg.tokens[start:end])),
                      "tool_calls": [c for c in calls if c["turn"] == index]})
    return turns


def build_records(step: int, groups: Sequence[Any], batch: Any, *, policy_version: int,
                  agents: Mapping[str, str], token_text: Callable[[list[int]], list[str]],
                  decode: Callable[[list[int]], str], keep: int = -1, seed: Any = 0,
                  filtered: Sequence[Any] = (), evaluated: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """The records of one step: every trajectory of ``groups``, then those of ``filtered`` (the groups
    as sampled, before filters) not in ``groups``, or ``keep`` of all these, with the batch rows
    that trained them; then every trajectory of ``evaluated`` (the held-out evaluation run before
    the step, never trained), marked ``"eval": true``. ``policy_version`` is the
    weight version the step trained from, so a trajectory's staleness is ``policy_version`` minus
    the oldest version among its tokens."""
    trajs = [t for g in groups for t in g.trajectories]
    n_kept = len(trajs)
    kept = {id(t) for t in trajs}  # a filter may keep a group's object or a copy with fewer trajectories
    trajs += [t for g in filtered for t in g.trajectories if id(t) not in kept]
    n_trained = len(trajs)
    chosen = keep_indices(n_trained, keep, seed, step)
    trajs += [t for g in evaluated for t in g.trajectories]
    chosen += list(range(n_trained, len(trajs)))
    rows = _row_index(batch)
    row_lists: dict[str, Any] = {}
    if rows:
        for name in ROW_TENSORS:
            tensor = batch.get(name)
            if tensor is not None and tensor.dim() == 2:
                row_lists[name] = tensor.detach().float().cpu().tolist()
    records = []
    for index in chosen:
        traj = trajs[index]
        segments = [_segment_record(seg, rows.get((traj.id, s)), token_text, row_lists)
                    for s, seg in enumerate(traj.segments)]
        versions = [v for seg in traj.segments for v, m in zip(seg.weight_versions, seg.loss_mask) if m and v >= 0]
        messages = jsonable(_messages_with_image_refs(list(traj.messages), getattr(traj, "images", None) or {}))
        calls = tool_calls_of(messages)
        metadata = jsonable(dict(traj.metadata))
        timing = metadata.pop("timing", {}) if isinstance(metadata, dict) else {}
        records.append({
            "format": FORMAT_VERSION,
            "step": int(step),
            "index": index,
            "step_total": len(trajs),
            "id": traj.id,
            "group_id": traj.group_id,
            "prompt_id": traj.prompt_id,
            "source": traj.source,
            "agent": agents.get(traj.source),
            "prompt": jsonable(traj.prompt),
            "label": jsonable(traj.label),
            "status": status_of(traj),
            "error": traj.error,
            "failure": jsonable(getattr(traj, "failure", None)),
            "finish_reason": traj.finish_reason,
            "response_text": traj.response_text,
            "response_length": int(traj.response_length),
            "messages": messages,
            "turns": _turns(traj.segments, calls, decode, traj.metadata),
            "tool_calls": calls,
            "reward": reward_record(traj.reward),
            "trained": any(s["row"] is not None for s in segments),
            "filtered": n_kept <= index < n_trained,
            "eval": index >= n_trained,
            "policy_version": int(policy_version),
            "weight_versions": [min(versions), max(versions)] if versions else None,
            "staleness": int(policy_version) - min(versions) if versions else None,
            "timing": timing,
            "metadata": metadata,
            "segments": segments,
        })
        if getattr(traj, "images", None):  # stored once per trajectory: sha256 -> base64 bytes
            records[-1]["images"] = dict(traj.images)
    return records


def dumps(record: Mapping[str, Any]) -> str:
    """One record as one line of JSON (strict: no NaN or Infinity, which browsers reject)."""
    return json.dumps(record, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
