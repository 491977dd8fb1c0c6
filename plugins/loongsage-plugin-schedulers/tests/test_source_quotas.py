"""Per-source quotas: every strategy trains each step's quota of each source, keeps its staleness
bound with sources of very different generation times, refills filter discards from the same
source, and carries its state through ``state_dict`` / ``load_state_dict``."""

from __future__ import annotations

import random

import pytest
from loongsage_plugin_schedulers import (
    NoWindowScheduler,
    SyncScheduler,
    WindowedFifoScheduler,
    WindowGatedScheduler,
    group_staleness,
)

from loongsage_hookspecs import CheckpointableScheduler, SchedulerContext, Segment, Trajectory, TrajectoryGroup


def make(factory, *, batch_size, stale_steps=1, quota=None, **args):
    """``factory(ctx, **args)`` as the host builds a scheduler: its context carries ``batch_size``,
    ``stale_steps`` and ``quota``; the rest are the job's ``scheduler_args``."""
    return factory(SchedulerContext(batch_size=batch_size, stale_steps=stale_steps, quota=quota), **args)

ALL = [SyncScheduler, NoWindowScheduler, WindowGatedScheduler, WindowedFifoScheduler]
SOURCES = ("a", "b", "c")


def quota(version: int) -> dict[str, int]:
    """Five groups a step, shares 2.5 / 1.5 / 1 rounded alternately (as the host's StepQuotas does)."""
    return {"a": 3, "b": 1, "c": 1} if version % 2 == 0 else {"a": 2, "b": 2, "c": 1}


def group(gid: str, source: str, versions: list[int]) -> TrajectoryGroup:
    seg = Segment()
    seg.append([1, 2], generated=False)
    seg.append(list(range(3, 3 + len(versions))), generated=True, logprobs=[-1.0] * len(versions),
               weight_version=versions)
    traj = Trajectory(id=f"{gid}-0", prompt_id=gid, group_id=gid, source=source, segments=[seg])
    return TrajectoryGroup(group_id=gid, prompt_id=gid, source=source, trajectories=[traj])


def simulate(sched, steps: int, seed: int, drop: float = 0.15) -> list[tuple[int, list[TrajectoryGroup]]]:
    """A random pipeline: source ``a`` is slow and heavy-tailed, ``c`` fast; each tick one in-flight
    group may produce a token (at the current version) or finish; a finished group is discarded with
    probability ``drop`` (a filter). Returns ``(version, batch)`` per trained step."""
    rng = random.Random(seed)
    speed = {"a": 0.15, "b": 0.5, "c": 0.9}
    version, n = 0, 0
    flying: dict[str, tuple[str, list[int]]] = {}
    buffer: list[TrajectoryGroup] = []
    trained = []
    for _ in range(20000):
        if len(trained) == steps:
            return trained
        for g in sched.evict(buffer, version):
            buffer.remove(g)
        for gid in sched.to_abort(version):
            flying.pop(gid)
            sched.on_discard(gid)
        batch = sched.select(buffer, version, sched.batch_size)
        if batch is not None:
            for g in batch:
                buffer.remove(g)
            trained.append((version, batch))
            version += 1
            sched.on_train_step(version)
            continue
        while sched.can_dispatch(len(flying), len(buffer), version):
            source = sched.next_source(version)
            assert source in SOURCES
            gid = f"g{n}"
            n += 1
            sched.on_dispatch(gid, version, source=source)
            flying[gid] = (source, [])
        if not flying:
            continue
        gid = rng.choice(sorted(flying))
        source, toks = flying[gid]
        toks.append(version)
        if rng.random() < speed[source] or (source == "a" and rng.random() < 0.02 and len(toks) > 30):
            del flying[gid]
            if rng.random() < drop:
                sched.on_discard(gid)
            else:
                g = group(gid, source, toks)
                sched.on_complete(g)
                buffer.append(g)
    raise AssertionError(f"{sched.name}: the pipeline stalled after {len(trained)} steps")


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("oversample", [0.0, 0.5])
def test_every_step_trains_each_sources_quota_within_the_bound(cls, oversample):
    for seed in range(3):
        sched = make(cls, batch_size=5, stale_steps=1, oversample=oversample, quota=quota)
        trained = simulate(sched, steps=12, seed=seed)
        for version, batch in trained:
            counts = {s: sum(g.source == s for g in batch) for s in SOURCES}
            assert counts == quota(version), (sched.name, seed, version)
            assert max(group_staleness(g, version) for g in batch) <= sched.bound
        if cls is not NoWindowScheduler:  # the windowed and sync strategies also run ahead
            assert sched.bound == 0 or any(group_staleness(g, v) == 1 for v, b in trained for g in b)


def test_partial_rollout_fill_keeps_every_quota_and_drops_nothing():
    # no_window by the newest token with the trainable fill: the slow, heavy-tailed source "a"
    # continues across updates, every step still trains each source's quota within one version of
    # each group's last token, and no group is evicted (filter discards are replaced, not dropped)
    for seed in range(3):
        sched = make(NoWindowScheduler, batch_size=5, stale_steps=1, quota=quota, staleness="newest",
                     fill="trainable")
        trained = simulate(sched, steps=12, seed=seed)
        for version, batch in trained:
            assert {s: sum(g.source == s for g in batch) for s in SOURCES} == quota(version)
            assert max(group_staleness(g, version, "newest") for g in batch) <= 1
        m = sched.metrics()
        assert m["rollout/dropped_stale_total"] == m["rollout/dropped_surplus_total"] == 0.0
        assert any(group_staleness(g, v) > 1 for v, b in trained for g in b if g.source == "a")  # spans updates


@pytest.mark.parametrize("cls", ALL)
def test_next_source_follows_the_free_places_and_dispatch_checks_the_source(cls):
    sched = make(cls, batch_size=5, stale_steps=0, quota=quota)
    got = []
    while sched.can_dispatch(len(got), 0, 0):
        source = sched.next_source(0)
        sched.on_dispatch(f"g{len(got)}", 0, source=source)
        got.append(source)
    assert sorted(got) == sorted("aaabc")  # the step at version 0: 3 / 1 / 1
    assert sched.next_source(0) is None
    with pytest.raises(ValueError, match="source 'z', not one of"):
        make(cls, batch_size=5, quota=quota).on_dispatch("x", 0, source="z")
    with pytest.raises(ValueError, match="adding up to batch_size 5"):
        make(cls, batch_size=5, quota=lambda v: {"a": 4}).can_dispatch(0, 0, 0)


def test_a_completed_group_must_keep_its_source():
    sched = make(WindowedFifoScheduler, batch_size=5, stale_steps=1, quota=quota)
    sched.on_dispatch("g0", 0, source="a")
    with pytest.raises(ValueError, match="has source 'b' but was dispatched for 'a'"):
        sched.on_complete(group("g0", "b", [0]))


@pytest.mark.parametrize("cls", ALL)
def test_state_dict_round_trip_continues_the_counters_and_version(cls):
    sched = make(cls, batch_size=5, stale_steps=1, quota=quota)
    simulate(sched, steps=4, seed=7)
    assert isinstance(sched, CheckpointableScheduler)
    state = sched.state_dict()
    fresh = make(cls, batch_size=5, stale_steps=1, quota=quota)
    fresh.load_state_dict(state)
    assert fresh.version == 4 and fresh.state_dict() == state
    assert fresh.metrics()["rollout/trained_total"] == 20.0
    # it continues the schedule: the next step is version 4's quota
    trained = simulate_from(fresh, version=4, steps=2)
    assert [{s: sum(g.source == s for g in b) for s in SOURCES} for _, b in trained] == [quota(4), quota(5)]
    with pytest.raises(ValueError, match="state is of scheduler"):
        make(cls, batch_size=5, quota=quota).load_state_dict({**state, "name": "other"})


def simulate_from(sched, version: int, steps: int) -> list[tuple[int, list[TrajectoryGroup]]]:
    """Dispatch, finish everything at once, train ``steps`` steps from ``version``."""
    trained, n = [], 0
    buffer: list[TrajectoryGroup] = []
    while len(trained) < steps:
        while sched.can_dispatch(0, len(buffer), version):
            source = sched.next_source(version)
            gid = f"r{n}"
            n += 1
            sched.on_dispatch(gid, version, source=source)
            g = group(gid, source, [version])
            sched.on_complete(g)
            buffer.append(g)
        batch = sched.select(buffer, version, 5)
        assert batch is not None
        for g in batch:
            buffer.remove(g)
        trained.append((version, batch))
        version += 1
        sched.on_train_step(version)
    return trained
