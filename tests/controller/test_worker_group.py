"""The worker group's one rule: shares per data-parallel replica, one answer per replica, rows
selected in the actor from the one shipped batch, metrics averaged once."""

from __future__ import annotations

import torch

from loongsage_core.controller.remote import LocalActor
from loongsage_core.controller.worker_group import WorkerGroup, mean_metrics
from loongsage_hookspecs import AggregationNorm, Batch


class RowsActor:
    """An actor face that answers with the rows it selected (log-probs = the row's input ids)."""

    def __init__(self, name: str, seen: list[tuple[str, str, list[int]]], width: int) -> None:
        self.name, self.seen, self.width = name, seen, width

    def forward_rows(self, batch: Batch, rows: list[int], reference: bool = False) -> dict[str, torch.Tensor]:
        self.seen.append((self.name, "reference" if reference else "forward", list(rows)))
        # a backend may answer narrower than the batch (trimmed padding): the group pads it back
        return {"logprobs": batch.select(rows)["input_ids"][:, :self.width].float()}

    def train_rows(self, batch: Batch, rows: list[int], norm: AggregationNorm) -> dict[str, float]:
        self.seen.append((self.name, "train", list(rows)))
        return {"train/rows": float(len(rows)), f"train/only_{self.name}": 1.0}


def batch_of(n: int, width: int = 4) -> Batch:
    ids = torch.arange(n * width).reshape(n, width)
    return Batch(tensors={"input_ids": ids, "loss_mask": torch.ones(n, width)}, meta={"source": ["a"] * n})


def test_replicas_share_rows_and_answer_once_in_row_order():
    seen: list = []
    # four ranks, two model replicas (tensor-parallel pairs): ranks 0, 1 -> replica 0; 2, 3 -> replica 1
    actors = [LocalActor(RowsActor(f"r{i}", seen, 3)) for i in range(4)]
    group = WorkerGroup(actors, dp_ranks=[0, 0, 1, 1], dp_size=2)
    batch = batch_of(5)
    shared = group.share(batch)
    assert shared is batch  # in-process actors: nothing is serialised
    out = group.forward(shared, batch, "logprobs")
    assert [(name, rows) for name, _, rows in seen] == [("r0", [0, 1, 2]), ("r1", [0, 1, 2]),
                                                        ("r2", [3, 4]), ("r3", [3, 4])]
    expected = batch["input_ids"].float().clone()
    expected[:, 3] = 0.0  # padded back to the batch's width once
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def test_every_rank_is_called_even_with_an_empty_share():
    seen: list = []
    group = WorkerGroup([LocalActor(RowsActor(f"r{i}", seen, 4)) for i in range(3)])
    batch = batch_of(2)
    out = group.forward(group.share(batch), batch, "logprobs", reference=True)
    assert [(name, kind, rows) for name, kind, rows in seen] == [("r0", "reference", [0]), ("r1", "reference", [1]),
                                                                 ("r2", "reference", [])]
    assert out.shape == (2, 4)


def test_mini_batches_are_row_indices_of_the_shipped_batch_split_by_the_same_rule():
    seen: list = []
    group = WorkerGroup([LocalActor(RowsActor(f"r{i}", seen, 4)) for i in range(2)])
    batch = batch_of(6)
    norm = AggregationNorm(num_tokens=1.0, num_sequences=1.0, max_response_length=1.0)
    metrics, count = group.train(group.share(batch), [([5, 3, 1], norm), ([4, 2], norm)])
    assert count == 2
    assert [(n, rows) for n, _, rows in seen] == [("r0", [5, 3]), ("r1", [1]), ("r0", [4]), ("r1", [2])]
    # per mini-batch the mean over ranks, then the mean over mini-batches
    assert metrics == {"train/rows": 1.25, "train/only_r0": 1.0, "train/only_r1": 1.0}


def test_mean_metrics_averages_each_key_over_the_dicts_that_have_it():
    assert mean_metrics([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}
    assert mean_metrics([]) == {}
