"""TeacherManager: per-source routing, scatter back into row order, bounded residency.

The teachers are small bigram language models built here (a torch module scoring token t from
token t - 1) that record which rows they scored and whether they were loaded when asked.
"""

from __future__ import annotations

import pytest
import torch
from loongsage_plugin_distill import TeacherManager
from loongsage_plugin_distill.teacher_manager import TeacherRoutingError

from loongsage_hookspecs import Batch, TeacherManagerContext, TeacherOutputs, TeacherRouter

VOCAB = 13


class Residency:
    """Counts loaded teachers across all of them and remembers the peak."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.peak = 0
        self.events: list[str] = []


class BigramTeacher(torch.nn.Module):
    def __init__(self, name: str, seed: int, residency: Residency) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g), requires_grad=False)
        self.name, self.residency = name, residency
        self.calls: list[list[str]] = []

    def load(self) -> None:
        assert self.name not in self.residency.loaded, f"{self.name} loaded twice"
        self.residency.loaded.add(self.name)
        self.residency.peak = max(self.residency.peak, len(self.residency.loaded))
        self.residency.events.append(f"load {self.name}")

    def offload(self) -> None:
        self.residency.loaded.remove(self.name)
        self.residency.events.append(f"offload {self.name}")

    def distribution(self, ids: torch.Tensor) -> torch.Tensor:
        """Aligned log-probs [b, T, V]: entry t is the distribution of token t given token t - 1."""
        log_q = torch.log_softmax(self.table[ids[:, :-1]], -1)
        return torch.nn.functional.pad(log_q, (0, 0, 1, 0))

    def forward(self, batch: Batch, *, topk: int = 0, return_logits: bool = False) -> TeacherOutputs:  # type: ignore[override]
        assert self.name in self.residency.loaded, f"{self.name} ran while offloaded"
        self.calls.append(list(batch.meta["sample_id"]))
        ids, att = batch["input_ids"], batch["attention_mask"]
        log_q = self.distribution(ids)
        valid = (att != 0) & (torch.arange(ids.shape[1]) > 0)
        lp = torch.where(valid, log_q.gather(-1, ids.unsqueeze(-1)).squeeze(-1), 0.0)
        out = TeacherOutputs(logprobs=lp)
        if topk:
            values, index = log_q.topk(topk, -1)
            out.topk_ids, out.topk_logprobs = index, values
        if return_logits:
            out.logits = log_q
        return out


SOURCES = ["a", "b", "c", "b", "a", "c", "b"]
ROUTES = {"a": "t1", "b": "t2", "c": "t1"}


def make_batch(sources: list[str], seed: int = 0, width: int = 6) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(sources), width), generator=g)
    lengths = torch.randint(2, width + 1, (len(sources),), generator=g)
    att = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = ids * att
    return Batch(tensors={"input_ids": ids, "attention_mask": att},
                 meta={"source": list(sources), "sample_id": [f"s{i}" for i in range(len(sources))]})


def make_teachers(residency: Residency, names=("t1", "t2")) -> dict[str, BigramTeacher]:
    return {name: BigramTeacher(name, seed, residency) for seed, name in enumerate(names)}


def test_routes_each_teacher_once_and_scatters_in_row_order():
    res = Residency()
    teachers = make_teachers(res)
    manager = TeacherManager(teachers, ROUTES, max_resident=2)
    batch = make_batch(SOURCES)
    out = manager.forward(batch, topk=3, return_logits=True)

    assert teachers["t1"].calls == [["s0", "s2", "s4", "s5"]]
    assert teachers["t2"].calls == [["s1", "s3", "s6"]]
    assert out.logprobs.shape == (7, 6) and out.topk_ids.shape == (7, 6, 3) and out.logits.shape == (7, 6, VOCAB)
    for row, source in enumerate(SOURCES):
        teacher = teachers[ROUTES[source]]
        single = teacher.forward(batch.select([row]), topk=3, return_logits=True)
        torch.testing.assert_close(out.logprobs[row], single.logprobs[0])
        torch.testing.assert_close(out.topk_ids[row], single.topk_ids[0])
        torch.testing.assert_close(out.topk_logprobs[row], single.topk_logprobs[0])
        torch.testing.assert_close(out.logits[row], single.logits[0])
    # the two teachers really differ, so a row given to the wrong one would show
    other = teachers["t2"].forward(batch.select([0]))
    assert not torch.allclose(out.logprobs[0], other.logprobs[0])
    assert bool(manager.row_mask(batch).all())


@pytest.mark.parametrize("limit", [1, 2])
def test_resident_limit_is_respected_across_steps(limit):
    res = Residency()
    teachers = make_teachers(res, names=("t1", "t2", "t3"))
    routes = {"a": "t1", "b": "t2", "c": "t3"}
    manager = TeacherManager(teachers, routes, max_resident=limit)
    for step in range(4):
        sources = [["a", "b", "c"], ["c", "a"], ["b", "c", "a", "b"], ["a"]][step]
        manager.forward(make_batch(sources, seed=step))
        assert len(manager.resident) <= limit
        assert res.loaded == set(manager.resident)
    assert res.peak == limit
    assert manager.loads - manager.offloads == len(manager.resident)
    manager.offload_all()
    assert res.loaded == set() and manager.resident == ()


def test_already_loaded_teachers_run_first_and_are_not_swapped():
    res = Residency()
    teachers = make_teachers(res)
    manager = TeacherManager(teachers, ROUTES, max_resident=1)
    batch = make_batch(SOURCES)
    manager.forward(batch)  # t1 (first row's teacher) then t2: t2 stays loaded
    assert manager.resident == ("t2",)
    assert list(manager.plan(batch)) == ["t2", "t1"]
    before = manager.loads
    manager.forward(batch)
    assert manager.loads == before + 1  # only t1 was loaded again
    assert res.events[-2:] == ["offload t2", "load t1"]

    roomy = TeacherManager(make_teachers(Residency()), ROUTES, max_resident=2)
    roomy.forward(batch)
    roomy.forward(batch)
    assert roomy.loads == 2 and roomy.offloads == 0


def test_max_resident_zero_offloads_after_each_forward():
    res = Residency()
    manager = TeacherManager(make_teachers(res), ROUTES, max_resident=0)
    manager.forward(make_batch(SOURCES))
    assert manager.resident == () and res.loaded == set() and res.peak == 1
    assert manager.loads == manager.offloads == 2


def test_sources_without_teacher_unknown_sources_and_default():
    res = Residency()
    teachers = make_teachers(res)
    manager = TeacherManager(teachers, {"a": "t1", "plain": None})
    batch = make_batch(["plain", "a", "plain"])
    out = manager.forward(batch, topk=2)
    assert manager.row_mask(batch).tolist() == [False, True, False]
    assert bool((out.logprobs[[0, 2]] == 0).all()) and bool((out.topk_ids[[0, 2]] == 0).all())
    assert float(out.logprobs[1].abs().sum()) > 0
    with pytest.raises(TeacherRoutingError, match="data source 'zzz' has no teacher route"):
        manager.forward(make_batch(["a", "zzz"]))
    manager.offload_all()  # the next manager drives the same teacher objects
    fallback = TeacherManager(teachers, {"a": "t1"}, default="t2")
    fallback.forward(make_batch(["zzz", "a"]))
    assert teachers["t2"].calls[-1] == ["s0"]
    with pytest.raises(TeacherRoutingError, match="unknown teacher 'nope'"):
        TeacherManager(teachers, {"a": "nope"})


def test_unmanaged_callable_teacher_and_output_checks():
    def constant(batch: Batch, *, topk: int = 0) -> TeacherOutputs:
        return TeacherOutputs(logprobs=torch.full(batch["input_ids"].shape, -1.5))

    res = Residency()
    manager = TeacherManager({"const": constant, **make_teachers(res)}, {"a": "const", "b": "t1"}, max_resident=1)
    out = manager.forward(make_batch(["b", "a", "b"]))
    assert out.logprobs[1].tolist() == [-1.5] * 6
    assert manager.resident == ("t1",)  # the plain function never counts as resident

    def wrong(batch: Batch, *, topk: int = 0) -> TeacherOutputs:
        return TeacherOutputs(logprobs=torch.zeros(len(batch) + 1, 6))

    with pytest.raises(ValueError, match="teacher 'wrong' returned logprobs of shape"):
        TeacherManager({"wrong": wrong}, {"a": "wrong"}).forward(make_batch(["a"]))
    with pytest.raises(ValueError, match="topk_ids"):
        TeacherManager({"const": constant}, {"a": "const"}).forward(make_batch(["a"]), topk=2)


def test_the_spec_factory_takes_the_teachers_routes_and_bound_from_its_context():
    from loongsage_plugin_distill import plugin

    spec = {s.name: s for s in plugin.loongsage_teacher_managers()}["per_source"]
    res = Residency()
    teachers = make_teachers(res)
    ctx = TeacherManagerContext(teachers=teachers, routes={"a": "t1", "b": "t2"}, max_resident=1)
    manager = spec.factory(ctx, default="t2")
    assert isinstance(manager, TeacherRouter) and manager.max_resident == 1
    manager.forward(make_batch(["a", "b", "zzz"]))
    assert res.peak == 1 and teachers["t2"].calls[-1] == ["s1", "s2"]
