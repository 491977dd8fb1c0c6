"""The rounding rules of prompt mixing (:mod:`.data`): exact integer weights, the quota method
across steps, and per-mini-batch / per-rank source shares inside a step.

* :func:`integer_weights` and :func:`quota_sequence`: the order in which :class:`.data.DataMixer`
  hands out prompts (Balinski and Young's quota method; see :mod:`.data`).
* :func:`interleave_by_source`: the step's rows ordered so that every mini-batch, and every
  data-parallel shard of a mini-batch, holds each source's share of its parent rounded down or up,
  the counts of every source adding up exactly to what the parent holds (:func:`round_shares`).
* :class:`StepQuotas`: the groups of each source in every step of an asynchronous run (floor or
  ceil of each share per step), which the scheduler fills.
"""

from __future__ import annotations

import math
import random
from collections import deque
from fractions import Fraction
from typing import Any, Hashable, Sequence

# --------------------------------------------------------------------------------------------
# Rounding rules
# --------------------------------------------------------------------------------------------


def integer_weights(weights: Sequence[float | int]) -> list[int]:
    """``weights`` scaled to integers with the same ratios, exactly.

    Each float is read as the decimal it prints as (``0.3`` is 3/10, not the nearest binary
    fraction), so decimal weights from a job file give the shares they say.
    """
    exact: list[Fraction] = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {i} must be a finite number >= 0, got {w!r}")
        exact.append(Fraction(repr(w)) if isinstance(w, float) else Fraction(w))
    if not any(exact):
        raise ValueError(f"at least one weight must be > 0, got {list(weights)}")
    scale = math.lcm(*(f.denominator for f in exact))
    return [int(f * scale) for f in exact]


def quota_sequence(weights: Sequence[int], counts: list[int], n: int) -> list[int]:
    """Hand out ``n`` more items one at a time by the quota method; return who got each.

    ``weights`` are non-negative integers (:func:`integer_weights`); ``counts`` holds the items
    each source has received so far and is updated in place. Item ``h`` (counting every item ever
    handed out) goes to the source with the largest ``weight / (count + 1)`` among those with
    ``count < h * weight / sum(weights)`` (ties: the earlier source). Every source's count then
    stays within ``floor`` and ``ceil`` of its exact share of ``h`` after every item
    (Balinski and Young's quota method: it satisfies quota and never takes an item back).
    """
    total_w = sum(weights)
    if total_w <= 0:
        raise ValueError(f"quota_sequence: weights must not all be 0, got {list(weights)}")
    if len(counts) != len(weights):
        raise ValueError(f"quota_sequence: {len(counts)} counts for {len(weights)} weights")
    h = sum(counts)
    out: list[int] = []
    for _ in range(n):
        h += 1
        best = -1
        for i, w in enumerate(weights):
            if counts[i] * total_w < h * w and (best < 0 or w * (counts[best] + 1) > weights[best] * (counts[i] + 1)):
                best = i
        # some source is always eligible: sum(counts) * total_w = (h - 1) * total_w < h * sum(weights)
        counts[best] += 1
        out.append(best)
    return out


def round_shares(totals: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Split each source's ``totals[s]`` items over blocks of ``sizes[k]`` items.

    Returns ``counts[k][s]``: each entry is ``floor`` or ``ceil`` of the exact share
    ``sizes[k] * totals[s] / sum(totals)``, every block ``k`` holds exactly ``sizes[k]`` items and
    every source exactly ``totals[s]``. Such a rounding always exists (the exact shares are a
    fractional flow with whole row and column sums, so an integral flow of the same value does);
    which blocks get the rounded-up entries is found by augmenting paths over the fractional
    cells, larger fractional parts tried first.
    """
    n = sum(totals)
    if sum(sizes) != n:
        raise ValueError(f"round_shares: block sizes add up to {sum(sizes)}, the totals to {n}")
    if any(t < 0 for t in totals) or any(s < 0 for s in sizes):
        raise ValueError(f"round_shares: negative entry in totals {list(totals)} or sizes {list(sizes)}")
    K, S = len(sizes), len(totals)
    if n == 0:
        return [[0] * S for _ in range(K)]
    base = [[sizes[k] * totals[s] // n for s in range(S)] for k in range(K)]
    rem = [[sizes[k] * totals[s] % n for s in range(S)] for k in range(K)]
    row_need = [sizes[k] - sum(base[k]) for k in range(K)]
    col_need = [totals[s] - sum(base[k][s] for k in range(K)) for s in range(S)]
    cells = [sorted((s for s in range(S) if rem[k][s]), key=lambda s: (-rem[k][s], s)) for k in range(K)]
    up = [[False] * S for _ in range(K)]
    for k in range(K):
        for _ in range(row_need[k]):
            if not _augment(k, cells, up, col_need):
                raise RuntimeError(f"round_shares: no rounding found for totals {list(totals)} and sizes "
                                   f"{list(sizes)}")
    return [[base[k][s] + int(up[k][s]) for s in range(S)] for k in range(K)]


def _augment(start: int, cells: list[list[int]], up: list[list[bool]], col_need: list[int]) -> bool:
    """One more rounded-up cell in block ``start``: an alternating path to a source still short."""
    K = len(cells)
    seen_rows = {start}
    parent: dict[tuple[str, int], tuple[str, int]] = {}
    queue = deque([start])
    while queue:
        k = queue.popleft()
        for s in cells[k]:
            if up[k][s] or ("col", s) in parent:
                continue
            parent[("col", s)] = ("row", k)
            if col_need[s] > 0:
                col_need[s] -= 1
                node: tuple[str, int] = ("col", s)
                while node in parent:  # flip the path: row->col cells go up, col->row cells go back down
                    kind, idx = parent[node]
                    if node[0] == "col":
                        up[idx][node[1]] = True
                    else:
                        up[node[1]][idx] = False
                    node = (kind, idx)
                return True
            for k2 in range(K):
                if up[k2][s] and k2 not in seen_rows:
                    seen_rows.add(k2)
                    parent[("row", k2)] = ("col", s)
                    queue.append(k2)
    return False


def interleave_by_source(sources: Sequence[Hashable], mini_batch_size: int, world_size: int = 1, *,
                         seed: Any = None) -> list[int]:
    """An order of a step's rows that gives every mini-batch and every rank its share of each source.

    ``sources[i]`` is row ``i``'s data source (``batch.meta["source"]``). The returned permutation
    is meant to be cut as the trainer cuts it: mini-batch ``j`` is ``order[j * mini_batch_size:
    (j + 1) * mini_batch_size]`` (the last one may be smaller) and its rank ``r`` gets the
    contiguous range ``batching.shard_rows(len(mini_batch), world_size)[r]`` of it (``world_size``:
    the data-parallel ranks; tensor and pipeline parallel peers share their replica's rows).

    Rounding rule (:func:`round_shares`, applied twice): mini-batch ``j`` of ``m_j`` rows holds
    ``floor`` or ``ceil`` of ``m_j * n_s / N`` rows of source ``s`` (``n_s`` of the step's ``N``
    rows), the counts of every source over all mini-batches adding up to ``n_s`` exactly; a rank's
    shard of ``w`` rows of that mini-batch holds ``floor`` or ``ceil`` of ``w * c_s / m_j`` of its
    ``c_s`` rows of ``s``, the shards adding up to ``c_s`` exactly. Inside a shard the sources
    are interleaved by :func:`quota_sequence`, so micro-batches are mixed too. Which rows of a
    source go where is random, from ``seed`` (any value ``random.Random`` accepts).
    """
    from .batching import shard_rows

    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
        raise ValueError(f"interleave_by_source: mini_batch_size must be an integer >= 1, got {mini_batch_size!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"interleave_by_source: world_size must be an integer >= 1, got {world_size!r}")
    labels: list[Hashable] = []
    pools: dict[Hashable, list[int]] = {}
    for i, src in enumerate(sources):
        if src not in pools:
            pools[src] = []
            labels.append(src)
        pools[src].append(i)
    rng = random.Random(seed)
    for rows in pools.values():
        rng.shuffle(rows)
    n = len(sources)
    totals = [len(pools[s]) for s in labels]
    sizes = [min(mini_batch_size, n - start) for start in range(0, n, mini_batch_size)]
    cursor = {s: 0 for s in labels}
    order: list[int] = []
    for size, mini_counts in zip(sizes, round_shares(totals, sizes)):
        shard_sizes = [len(r) for r in shard_rows(size, world_size)]
        for shard_counts in round_shares(mini_counts, shard_sizes):
            if not any(shard_counts):
                continue
            for s_idx in quota_sequence(shard_counts, [0] * len(labels), sum(shard_counts)):
                src = labels[s_idx]
                order.append(pools[src][cursor[src]])
                cursor[src] += 1
    return order


# --------------------------------------------------------------------------------------------
# Per-step source quotas (asynchronous training)
# --------------------------------------------------------------------------------------------


class StepQuotas:
    """How many of a train step's ``batch_size`` groups each source gives, step by step.

    The asynchronous loop cannot take its sources' shares from the order prompts are drawn in
    (groups finish out of order, filters and re-queues shift the mix), so every step gets a quota
    per source and the scheduler fills it. Rounding rule:

    * **within a step**: source ``s`` gets ``floor`` or ``ceil`` of its exact share
      ``batch_size * w_s / sum(w)``, the counts adding up to ``batch_size``;
    * **across steps**: the rounded-up places go, step by step, to the sources furthest behind
      their exact running share (a source that must get one to stay within ``floor`` of it first),
      so after ``k`` steps each source's total is the ``floor`` or ``ceil`` of ``k * batch_size *
      w_s / sum(w)``, as the synchronous :class:`.data.DataMixer` keeps it per prompt
      (``tests/test_step_quotas.py`` checks this for up to four sources over many weights and
      sizes; with five or more sources this greedy rule does not guarantee it: a running total
      can, seldom, be one further off; the test checks it stays less than two from the share).

    Deterministic: ``quotas(k)`` depends only on the weights, ``batch_size`` and ``k``, so a resumed
    run continues the same schedule. Weights are read exactly (:func:`integer_weights`).
    """

    def __init__(self, weights: Sequence[float | int], batch_size: int) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"StepQuotas: batch_size must be an integer >= 1, got {batch_size!r}")
        self.weights = integer_weights(weights)
        self.batch_size = batch_size
        total = sum(self.weights)
        self._total = total
        self._base = [batch_size * w // total for w in self.weights]
        self._rem = [batch_size * w % total for w in self.weights]  # fractional part, in units of 1/total
        self._extra = batch_size - sum(self._base)  # rounded-up places per step
        self._plan: list[list[int]] = []
        self._ups = [0] * len(self.weights)  # rounded-up places given so far, per source

    def __call__(self, step: int) -> list[int]:
        """Groups per source (in the weights' order) for train step ``step`` (0-based)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"StepQuotas: step must be an integer >= 0, got {step!r}")
        while len(self._plan) <= step:
            self._plan.append(self._next())
        return list(self._plan[step])

    def _next(self) -> list[int]:
        k = len(self._plan) + 1  # steps done after this one
        total = self._total
        # lag of source s if it gets no rounded-up place now: k * rem_s / total - ups_s (times total)
        lag = [k * r - total * u for r, u in zip(self._rem, self._ups)]
        eligible = [s for s, r in enumerate(self._rem) if r and lag[s] > 0]  # below its ceiling
        if len(eligible) < self._extra:  # cannot happen while the running totals keep their quota
            eligible = [s for s, r in enumerate(self._rem) if r]
        # first those that would fall below floor (lag >= 1), then the largest lag, then source order
        chosen = sorted(eligible, key=lambda s: (-(lag[s] >= total), -lag[s], s))[:self._extra]
        out = list(self._base)
        for s in chosen:
            out[s] += 1
            self._ups[s] += 1
        return out
