"""What became of every group an asynchronous run generated: trained, dropped, or aborted.

An async scheduler may throw generated work away (``no_window`` evicts groups staler than the
bound, oversampling drops the surplus, filters discard groups, ``partial = false`` aborts
unfinished generations at each weight update) and may favour short generations (they finish
first). Both costs are invisible in the trained batches alone, so the loop keeps this ledger of
every group whose generation finished and reports, as run totals in each step's metrics:

* ``rollout/waste_ratio``: generated tokens never trained (dropped or aborted groups) over the
  tokens of every group decided so far (trained or dropped); groups still generating or buffered
  are not decided yet. ``rollout/wasted_tokens_total``, ``rollout/generated_tokens_total`` with it,
  and ``rollout/aborted_groups_total`` (groups cancelled while generating: their tokens are not
  reported back, so they are counted as groups only).
* the response-length distributions of the sampled trajectories (every decided generation:
  trained or dropped) and of the trained ones: ``rollout/length_sampled_mean`` / ``_p90``,
  ``rollout/length_trained_mean`` / ``_p90``, and ``rollout/length_ks``, the two-sample
  Kolmogorov-Smirnov distance between them (0: the same distribution; a scheduler that drops long
  generations pushes it up).

Lengths are kept as counts per length (bounded by ``max_new_tokens``), so the ledger stays small
over long runs. The totals are the loop's, not the checkpoint's: a resumed run counts from the
resume.
"""

from __future__ import annotations

import collections
from typing import Iterable

from loongsage_hookspecs import TrajectoryGroup


def group_tokens(group: TrajectoryGroup) -> int:
    """Generated tokens of ``group`` (the response lengths of its trajectories)."""
    return sum(int(t.response_length) for t in group.trajectories)


def ks_distance(a: collections.Counter[int], b: collections.Counter[int]) -> float:
    """Two-sample Kolmogorov-Smirnov distance between two samples given as counts per value:
    the largest gap between their empirical distribution functions (0 when either is empty)."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return 0.0
    ca = cb = 0
    gap = 0.0
    for value in sorted(set(a) | set(b)):
        ca += a.get(value, 0)
        cb += b.get(value, 0)
        gap = max(gap, abs(ca / na - cb / nb))
    return gap


def quantile(counts: collections.Counter[int], q: float) -> float:
    """The smallest value with at least a share ``q`` of the sample at or below it (0 when empty)."""
    total = sum(counts.values())
    if not total:
        return 0.0
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= q * total:
            return float(value)
    return float(max(counts))  # pragma: no cover - q <= 1 always stops in the loop


def mean(counts: collections.Counter[int]) -> float:
    """The mean of a sample given as counts per value (0 when empty)."""
    total = sum(counts.values())
    return sum(v * n for v, n in counts.items()) / total if total else 0.0


class RolloutLedger:
    """Run totals of generated, trained and wasted work and the sampled vs trained response
    lengths (see the module docstring). The async loop reports each event once."""

    def __init__(self) -> None:
        self.pending: dict[str, list[int]] = {}  # finished, not decided yet: group id -> response lengths
        self.sampled_lengths: collections.Counter[int] = collections.Counter()
        self.trained_lengths: collections.Counter[int] = collections.Counter()
        self.generated_tokens = 0
        self.trained_tokens = 0
        self.wasted_tokens = 0
        self.aborted_groups = 0

    def finished(self, group: TrajectoryGroup) -> None:
        """A group's generation finished (whatever happens to it next)."""
        self.pending[group.group_id] = [int(t.response_length) for t in group.trajectories]
        self.generated_tokens += group_tokens(group)

    def _decide(self, group: TrajectoryGroup) -> None:
        lengths = self.pending.pop(group.group_id, None)
        if lengths is None:
            lengths = [int(t.response_length) for t in group.trajectories]
        self.sampled_lengths.update(lengths)

    def trained(self, groups: Iterable[TrajectoryGroup]) -> None:
        """A train step trained ``groups``."""
        for g in groups:
            self._decide(g)
            self.trained_lengths.update(int(t.response_length) for t in g.trajectories)
            self.trained_tokens += group_tokens(g)

    def dropped(self, group: TrajectoryGroup) -> None:
        """A finished group will never be trained (evicted, filtered out, aborted at an update)."""
        self._decide(group)
        self.wasted_tokens += group_tokens(group)

    def aborted(self) -> None:
        """A group was cancelled while generating (its tokens are not reported back)."""
        self.aborted_groups += 1

    def metrics(self) -> dict[str, float]:
        """The run totals, for every step's metrics."""
        decided = self.trained_tokens + self.wasted_tokens
        return {
            "rollout/waste_ratio": self.wasted_tokens / decided if decided else 0.0,
            "rollout/wasted_tokens_total": float(self.wasted_tokens),
            "rollout/generated_tokens_total": float(self.generated_tokens),
            "rollout/aborted_groups_total": float(self.aborted_groups),
            "rollout/length_sampled_mean": mean(self.sampled_lengths),
            "rollout/length_sampled_p90": quantile(self.sampled_lengths, 0.9),
            "rollout/length_trained_mean": mean(self.trained_lengths),
            "rollout/length_trained_p90": quantile(self.trained_lengths, 0.9),
            "rollout/length_ks": ks_distance(self.sampled_lengths, self.trained_lengths),
        }
