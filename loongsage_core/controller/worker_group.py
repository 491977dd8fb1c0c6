"""One dispatcher for the model actors of a role (policy trainer ranks, the reference they hold,
critic ranks): how the step's rows reach them and how their answers come back.

One rule for every role:

* **Sharding**: a contiguous, near-equal share of the rows per data-parallel rank
  (:func:`.batching.shard_rows`); every rank of one model replica (tensor / pipeline parallel
  peers) gets its replica's share, and every rank is called, an empty share included (ranks of
  one group must run their collectives together).
* **Shipping**: the driver serialises the step's batch once (:meth:`WorkerGroup.share`: one
  ``ray.put``) and every call carries that object reference plus the row indices the rank
  selects (``batch.select(rows)`` runs in the actor), instead of pickling the selected rows again
  for old log-probs, the reference, critic values, each epoch's mini-batches and critic training.
* **Gathering**: one answer per model replica, in row order, right-padded to the batch's width
  once (:meth:`WorkerGroup.forward`); training metrics are averaged over the ranks' answers once
  per mini-batch and over the mini-batches once per step (:func:`mean_metrics`).

The actors implement ``forward_rows(batch, rows, reference)`` and ``train_rows(batch, rows,
norm)`` (:class:`.actors.ModelActor`, :class:`.critic.CriticActor`). Calls go through
:func:`.remote.gather`, so :class:`.remote.LocalActor` handles work too (then the batch is handed
over as it is, nothing is serialised).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Sequence

import torch

from loongsage_hookspecs import AggregationNorm, Batch

from .batching import balanced_shards, shard_rows
from .remote import LocalActor, gather


def mean_metrics(items: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the dicts that have it."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for m in items:
        for k, v in m.items():
            sums[k] += float(v)
            counts[k] += 1
    return {k: sums[k] / counts[k] for k in sums}


class WorkerGroup:
    """The actors of one role with their data-parallel layout.

    ``dp_ranks[i]`` is the data-parallel rank of ``actors[i]`` (ranks of one model replica share
    one); ``dp_size`` the number of replicas.
    """

    def __init__(self, actors: Sequence[Any], dp_ranks: Sequence[int] | None = None,
                 dp_size: int | None = None, *, balance_tokens: bool = False) -> None:
        self.actors = list(actors)
        self.balance_tokens = balance_tokens
        self.dp_ranks = list(range(len(self.actors))) if dp_ranks is None else list(dp_ranks)
        self.dp_size = len(self.actors) if dp_size is None else int(dp_size)
        if len(self.dp_ranks) != len(self.actors):
            raise ValueError(f"WorkerGroup: {len(self.actors)} actors but {len(self.dp_ranks)} data-parallel ranks")

    def rows_per_actor(self, rows: Sequence[int], batch: Batch | None = None) -> list[list[int]]:
        """Which of ``rows`` each actor gets: its replica's contiguous share, or, with
        ``balance_tokens`` (packed micro-batches) and ``batch`` given, a share with as many rows
        and near-equal tokens (:func:`.batching.balanced_shards`)."""
        if self.balance_tokens and batch is not None and self.dp_size > 1 and "attention_mask" in batch:
            lengths = batch["attention_mask"].sum(dim=1).tolist()
            shards = balanced_shards([lengths[i] for i in rows], self.dp_size)
        else:
            shards = shard_rows(len(rows), self.dp_size)
        return [[rows[i] for i in shards[r]] for r in self.dp_ranks]

    def share(self, batch: Batch) -> Any:
        """The handle the actors receive for ``batch``: one ``ray.put`` (Ray resolves the reference
        to the batch in each actor), or the batch itself for in-process actors."""
        if all(isinstance(a, LocalActor) for a in self.actors):
            return batch
        import ray

        return ray.put(batch)

    def call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every actor; their answers in actor order."""
        return gather([getattr(a, method).remote(*args) for a in self.actors])

    def forward(self, shared: Any, batch: Batch, key: str, *, reference: bool = False) -> torch.Tensor:
        """``key`` (``logprobs``, ``values``) of every row of ``batch`` (shipped as ``shared``),
        ``[B, T]`` float32, right-padded to the batch's width."""
        return self.forward_outputs(shared, batch, (key,), reference=reference)[key]

    def forward_outputs(self, shared: Any, batch: Batch, keys: Sequence[str], *,
                        reference: bool = False) -> dict[str, torch.Tensor]:
        """:meth:`forward` for several ``keys`` of one pass; a key after the first that the
        workers did not return is left out."""
        n = len(batch)
        calls, replica_of = [], []
        for actor, rows, replica in zip(self.actors, self.rows_per_actor(range(n), batch), self.dp_ranks):
            calls.append(actor.forward_rows.remote(shared, rows, reference))
            replica_of.append(replica)
        # every rank of a model replica returns the same rows: keep one answer per replica, in order
        first: dict[int, Any] = {}
        for replica, out in zip(replica_of, gather(calls)):
            first.setdefault(replica, out)
        width = batch["input_ids"].shape[1]
        out = {}
        for i, key in enumerate(keys):
            if i and any(key not in first[r] for r in first):
                continue
            parts = [first[r][key] for r in sorted(first)]
            out[key] = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts], 0).float()
        return out

    def training_forward_logprobs(self, batch: Batch, rows: Sequence[int]) -> torch.Tensor | None:
        """The log-probs ``[B, T]`` the last mini-batch (``rows`` of ``batch``) was trained with,
        placed at their rows (0 elsewhere), when every replica kept them (the step's old log-probs
        came from the training forward), else ``None``."""
        answers = self.call("training_forward_logprobs")
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        done: set[int] = set()
        for replica, share, got in zip(self.dp_ranks, self.rows_per_actor(rows, batch), answers):
            if replica in done or not share:
                continue
            if got is None or got.shape[0] != len(share):
                return None
            out[torch.as_tensor(share, dtype=torch.long), :got.shape[1]] = got.float()
            done.add(replica)
        return out

    def train(self, shared: Any, mini_batches: Iterable[tuple[list[int], AggregationNorm]],
              batch: Batch | None = None) -> tuple[dict[str, float], int]:
        """One optimiser step per mini-batch (its rows of the shared batch and its global norm),
        split over the ranks; the metrics averaged over ranks, then over mini-batches, and the
        number of mini-batches."""
        results: list[dict[str, float]] = []
        for rows, norm in mini_batches:
            calls = [a.train_rows.remote(shared, share, norm)
                     for a, share in zip(self.actors, self.rows_per_actor(rows, batch))]
            results.append(mean_metrics(gather(calls)))
        return mean_metrics(results), len(results)
