"""Turning trajectory groups into a padded training :class:`Batch`.

Every trainable segment of a trajectory that is trained on becomes one row; rows of the same
prompt share a ``group_index`` so group-relative advantage estimators can find their peers, and
rows of the same trajectory share a ``sample_index`` so a trajectory split into several segments
counts once in its group's statistics.

Which trajectories are trained on is the credit rule of :func:`is_trained`: completed ones, and
failed ones by whose fault they failed (``Trajectory.failure``). The policy's own failures
(``agent``) count, with reward 0, as a wrong answer does; infrastructure failures (``infra``, or
a failure of unknown class) are left out of the group, so its statistics are those of the
samples that really ran (``[algorithm] infra_failures = "exclude"``), or count with reward 0
(``"zero_reward"``). A group left with fewer than ``min_group_samples`` trained samples is
dropped whole, as a filter would drop it: a group-relative estimator learns nothing from one.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from loongsage_hookspecs import Batch, FailureClass, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus


def is_trained(traj: Trajectory, infra_failures: str = "exclude") -> bool:
    """Whether ``traj`` takes part in its group's statistics and the loss: completed, or failed
    by the policy (``agent``), or failed by the infrastructure under ``infra_failures =
    "zero_reward"``. Aborted (and unfinished) trajectories never are."""
    if traj.status == TrajectoryStatus.COMPLETED:
        return True
    if traj.status != TrajectoryStatus.FAILED:
        return False
    return traj.failure == FailureClass.AGENT or infra_failures == "zero_reward"


def credit_options(job: Any, host: Any) -> dict[str, Any]:
    """:func:`build_batch`'s credit settings for ``job``: its ``[algorithm] infra_failures`` and,
    for a group-relative advantage estimator (its spec's ``group_relative``), groups of two
    trained samples at least."""
    group_relative = bool(host.get("advantage", job.algorithm.advantage).group_relative)
    return {"infra_failures": job.algorithm.infra_failures, "min_group_samples": 2 if group_relative else 1}


def build_batch(groups: Sequence[TrajectoryGroup], pad_id: int = 0, *, mask_stale: bool = False,
                infra_failures: str = "exclude", min_group_samples: int = 1) -> Batch:
    """Rows for every trainable segment of every trajectory trained on (:func:`is_trained`),
    right-padded; a group with fewer than ``min_group_samples`` such trajectories (with a
    trainable segment) gives no row.

    ``mask_stale`` drops from the loss mask every generated token whose weight version is older
    than the newest version in its trajectory (the off-policy prefix of a partial rollout).
    """
    rows: list[tuple[int, int, Any, Any]] = []
    samples = 0
    for g_idx, group in enumerate(groups):
        group_rows: list[tuple[int, int, Any, Any]] = []
        first = samples
        for traj in group.trajectories:
            if not is_trained(traj, infra_failures):
                continue
            trainable = [(s_idx, seg) for s_idx, seg in enumerate(traj.segments) if seg.trainable]
            group_rows += [(g_idx, samples, traj, item) for item in trainable]
            samples += bool(trainable)
        if samples - first < min_group_samples:
            samples = first  # the group is dropped whole: its sample indices are given again
            continue
        rows += group_rows
    if not rows:
        return Batch()
    width = max(len(seg.tokens) for _, _, _, (_, seg) in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    rewards = torch.zeros(n, dtype=torch.float32)
    group_index = torch.zeros(n, dtype=torch.long)
    sample_index = torch.zeros(n, dtype=torch.long)
    routes = routed_experts_tensor([seg for _, _, _, (_, seg) in rows], width)
    meta: dict[str, list[Any]] = {"trajectory_id": [], "prompt_id": [], "source": [], "segment": []}
    images: list[list[str] | None] = []
    for i, (g_idx, sample, traj, (s_idx, seg)) in enumerate(rows):
        L = len(seg.tokens)
        input_ids[i, :L] = torch.tensor(seg.tokens, dtype=torch.long)
        attention[i, :L] = 1
        loss_mask[i, :L] = torch.tensor(seg.loss_mask, dtype=torch.float32)
        if mask_stale:
            newest = max((v for s in traj.segments for v in s.weight_versions), default=-1)
            stale = torch.tensor([0 <= v < newest for v in seg.weight_versions], dtype=torch.bool)
            loss_mask[i, :L][stale] = 0.0
        logprobs[i, :L] = torch.tensor(seg.logprobs, dtype=torch.float32)
        versions[i, :L] = torch.tensor(seg.weight_versions, dtype=torch.long)
        rewards[i] = traj.score
        group_index[i] = g_idx
        sample_index[i] = sample
        meta["trajectory_id"].append(traj.id)
        meta["prompt_id"].append(traj.prompt_id)
        meta["source"].append(traj.source)
        meta["segment"].append(s_idx)
        images.append(segment_images(traj, seg))
    tensors = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
               "rollout_logprobs": logprobs, "weight_versions": versions, "rewards": rewards,
               "group_index": group_index, "sample_index": sample_index}
    if routes is not None:
        tensors["routed_experts"] = routes
    if any(images):  # rows of a vision-language policy's conversations with images
        meta["images"] = images
    if any(seg.constraints for _, _, _, (_, seg) in rows):  # grammar spans the trainer replays
        meta["constraints"] = [[(c.start, c.end, c.grammar, list(c.stop_token_ids)) for c in seg.constraints]
                               for _, _, _, (_, seg) in rows]
    return Batch(tensors=tensors, meta=meta)


def segment_images(traj: Trajectory, seg: Segment) -> list[str] | None:
    """The base64 bytes of ``seg``'s images in token order (``None``: it has none), from the
    trajectory's image store; the trainer rebuilds the vision inputs from them."""
    if not seg.images:
        return None
    missing = [image.sha256[:12] for image in seg.images if image.sha256 not in traj.images]
    if missing:
        raise ValueError(f"trajectory {traj.id}: its segments refer to images {missing} it does not store")
    return [traj.images[image.sha256] for image in seg.images]


def routed_experts_tensor(segments: Sequence[Segment], width: int) -> torch.Tensor | None:
    """The ``routed_experts`` rows ``[B, width, layers * top_k]`` (int16, -1 where nothing was
    recorded: padding, a segment without a record, its last token) of ``segments``, or ``None``
    when none has a record. Segments recorded with different model shapes are a ``ValueError``."""
    recorded = [seg.routed_experts for seg in segments if seg.routed_experts is not None]
    if not recorded:
        return None
    shapes = sorted({r.width for r in recorded})
    if len(shapes) > 1:
        raise ValueError(f"routed experts of the batch's segments have {shapes} ids per token: they were "
                         "recorded from different models")
    out = torch.full((len(segments), width, shapes[0]), -1, dtype=torch.int16)
    for i, seg in enumerate(segments):
        if seg.routed_experts is not None:
            out[i, :len(seg.tokens)] = seg.routed_experts.to_tensor()
    return out


def balanced_shards(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices split into ``parts`` shards with the row counts of :func:`shard_rows` and
    near-equal token counts (``lengths``): longest rows first, each to the shard with the fewest
    tokens that still has room. Rows keep ascending order inside a shard."""
    sizes = [len(s) for s in shard_rows(len(lengths), parts)]
    shards: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r)):
        best = min((r for r in range(parts) if len(shards[r]) < sizes[r]), key=lambda r: (tokens[r], r))
        shards[best].append(i)
        tokens[best] += int(lengths[i])
    return [sorted(s) for s in shards]


def shard_rows(n: int, world_size: int) -> list[list[int]]:
    """Contiguous, near-equal row ranges for each data-parallel rank."""
    base, extra = divmod(n, world_size)
    out, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out
