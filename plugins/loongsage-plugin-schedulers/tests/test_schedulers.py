"""Each strategy's dispatch, selection and eviction rules on small hand-made scenarios, argument
checks, the errors a controller gets when its calls disagree with the scheduler, and metrics."""

from __future__ import annotations

import math

import pytest
from loongsage_plugin_schedulers import (
    NoWindowScheduler,
    SyncScheduler,
    WindowedFifoScheduler,
    WindowGatedScheduler,
    group_staleness,
    token_staleness_mean,
)

from loongsage_hookspecs import Scheduler, SchedulerContext, Segment, Trajectory, TrajectoryGroup


def make(factory, *, batch_size, stale_steps=1, quota=None, **args):
    """``factory(ctx, **args)`` as the host builds a scheduler: its context carries ``batch_size``,
    ``stale_steps`` and ``quota``; the rest are the job's ``scheduler_args``."""
    return factory(SchedulerContext(batch_size=batch_size, stale_steps=stale_steps, quota=quota), **args)

ALL = [SyncScheduler, NoWindowScheduler, WindowGatedScheduler, WindowedFifoScheduler]


def group(gid: str, *versions: int | list[int]) -> TrajectoryGroup:
    """A group with one trajectory per argument; an int is one generated token of that version, a
    list gives one token per entry. Every trajectory starts with two prompt tokens (version -1)."""
    trajs = []
    for i, vs in enumerate(versions):
        vs = [vs] if isinstance(vs, int) else vs
        seg = Segment()
        seg.append([1, 2], generated=False)
        seg.append(list(range(3, 3 + len(vs))), generated=True, logprobs=[-1.0] * len(vs), weight_version=vs)
        trajs.append(Trajectory(id=f"{gid}-{i}", prompt_id=gid, group_id=gid, segments=[seg]))
    return TrajectoryGroup(group_id=gid, prompt_id=gid, trajectories=trajs)


class Driver:
    """A minimal controller around one scheduler (the loop of the Scheduler protocol, by hand)."""

    def __init__(self, sched) -> None:
        self.s = sched
        self.version = 0
        self.in_flight: set[str] = set()
        self.buffer: list[TrajectoryGroup] = []

    def dispatch_all(self) -> list[str]:
        out = []
        while self.s.can_dispatch(len(self.in_flight), len(self.buffer), self.version):
            gid = f"g{self.s.metrics()['rollout/dispatched_total']:.0f}"
            self.s.on_dispatch(gid, self.version)
            self.in_flight.add(gid)
            out.append(gid)
        return out

    def finish(self, gid: str, *versions) -> TrajectoryGroup:
        g = group(gid, *(versions or (self.version,)))
        self.in_flight.remove(gid)
        self.s.on_complete(g)
        self.buffer.append(g)
        return g

    def discard(self, gid: str) -> None:
        self.in_flight.remove(gid)
        self.s.on_discard(gid)

    def evict(self) -> list[str]:
        out = self.s.evict(self.buffer, self.version)
        for g in out:
            self.buffer.remove(g)
        return [g.group_id for g in out]

    def select(self) -> list[str] | None:
        batch = self.s.select(self.buffer, self.version, self.s.batch_size)
        if batch is None:
            return None
        for g in batch:
            self.buffer.remove(g)
        return [g.group_id for g in batch]

    def step(self) -> None:
        self.version += 1
        self.s.on_train_step(self.version)


# ------------------------------------------------------------------------ staleness definitions


def test_staleness_definitions_use_generated_tokens_only():
    g = group("a", [3, 4], 5)  # two trajectories, prompt tokens carry -1
    assert group_staleness(g, 6) == 3  # oldest token: version 3
    assert group_staleness(g, 6, "newest") == 1
    assert token_staleness_mean([g], 6) == pytest.approx((3 + 2 + 1) / 3)
    empty = TrajectoryGroup(group_id="e", prompt_id="e", trajectories=[Trajectory(id="t", prompt_id="e", group_id="e")])
    assert group_staleness(empty, 9) == 0 and token_staleness_mean([empty], 9) == 0.0
    with pytest.raises(ValueError, match="median"):
        group_staleness(g, 6, "median")


# ------------------------------------------------------------------------ arguments


@pytest.mark.parametrize("cls", ALL)
def test_arguments_are_validated(cls):
    with pytest.raises(ValueError, match="batch_size"):
        make(cls, batch_size=0)
    with pytest.raises(TypeError, match="batch_size"):
        make(cls, batch_size="4")
    with pytest.raises(ValueError, match="stale_steps"):
        make(cls, batch_size=4, stale_steps=-1)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="oversample"):
            make(cls, batch_size=4, oversample=bad)
    with pytest.raises(TypeError, match="oversample"):
        make(cls, batch_size=4, oversample=True)
    with pytest.raises(ValueError, match="oldest, newest"):
        make(cls, batch_size=4, staleness="median")
    with pytest.raises(TypeError):
        make(cls, batch_size=4, window=3)  # unknown argument


@pytest.mark.parametrize("cls", ALL)
def test_every_strategy_implements_the_protocol(cls):
    assert isinstance(make(cls, batch_size=2), Scheduler)


@pytest.mark.parametrize(("b", "o", "per_step"), [(8, 0.0, 8), (8, 0.25, 10), (8, 0.1, 9), (10, 0.1, 11), (3, 1.0, 6)])
def test_per_step_and_capacity(b, o, per_step):
    assert make(NoWindowScheduler, batch_size=b, stale_steps=2, oversample=o).capacity == per_step * 3
    assert make(WindowGatedScheduler, batch_size=b, stale_steps=1, oversample=o).per_step == per_step
    sync = make(SyncScheduler, batch_size=b, stale_steps=5, oversample=o)
    assert (sync.bound, sync.capacity) == (0, per_step)


# ------------------------------------------------------------------------ sync


def test_sync_dispatches_one_round_and_trains_exactly_it():
    d = Driver(make(SyncScheduler, batch_size=2, stale_steps=3))
    assert d.dispatch_all() == ["g0", "g1"]
    d.finish("g1")
    assert d.select() is None  # g0 still generating: a round is trained whole
    assert d.dispatch_all() == []
    d.finish("g0")
    assert d.select() == ["g0", "g1"]  # dispatch order
    assert d.dispatch_all() == []  # nothing before the weights are updated
    d.step()
    assert d.dispatch_all() == ["g2", "g3"]
    assert d.s.metrics()["rollout/staleness_max"] == 0.0


def test_sync_tops_up_after_a_discard_and_waits_for_an_empty_pipeline():
    d = Driver(make(SyncScheduler, batch_size=2, oversample=0.5))  # per_step 3
    assert d.dispatch_all() == ["g0", "g1", "g2"]
    d.discard("g0")
    assert d.dispatch_all() == ["g3"]  # replacement for the filtered group
    for gid in ("g1", "g2", "g3"):
        d.finish(gid)
    assert d.select() == ["g1", "g2"]
    assert d.evict() == ["g3"]  # surplus of the oversampled round
    d.step()
    assert d.dispatch_all() == ["g4", "g5", "g6"]
    assert d.s.metrics()["rollout/dropped_surplus"] == 1.0


def test_sync_drops_groups_generated_by_older_weights():
    d = Driver(make(SyncScheduler, batch_size=1))
    d.dispatch_all()
    d.finish("g0")
    d.select()
    d.step()
    (g1,) = d.dispatch_all()
    d.finish(g1, 0)  # an engine still serving version 0 although the controller announced version 1
    assert d.select() is None
    assert d.evict() == [g1]
    assert d.s.metrics()["rollout/dropped_stale_total"] == 1.0


# ------------------------------------------------------------------------ no_window


def test_no_window_fills_capacity_and_trains_in_completion_order():
    d = Driver(make(NoWindowScheduler, batch_size=2, stale_steps=1))
    assert len(d.dispatch_all()) == 4
    d.finish("g3")
    d.finish("g1")
    d.finish("g2")
    assert d.select() == ["g3", "g1"]
    assert d.dispatch_all() == ["g4", "g5"]  # capacity 4: g0, g2 and two new ones


def test_no_window_evicts_only_groups_beyond_the_bound():
    d = Driver(make(NoWindowScheduler, batch_size=1, stale_steps=1))
    d.dispatch_all()  # g0, g1
    d.finish("g0")
    assert d.select() == ["g0"]
    d.step()  # version 1
    d.dispatch_all()  # g2
    d.finish("g1", [0, 1])  # partial rollout: started under version 0, finished under 1
    assert d.evict() == []  # staleness 1 == bound: still trainable
    d.finish("g2")
    assert d.select() == ["g1"]
    d.step()  # version 2: g2 (version 1) has staleness 1
    assert d.evict() == []
    d.dispatch_all()
    assert d.select() == ["g2"]
    d.step()  # version 3
    d.finish("g3", 1)  # dispatched at 1, generated at 1: staleness 2 > 1
    assert d.evict() == ["g3"]
    m = d.s.metrics()
    assert m["rollout/dropped_stale_total"] == 1.0 and m["rollout/dropped_surplus_total"] == 0.0


def test_no_window_newest_token_definition_keeps_mixed_groups():
    oldest = Driver(make(NoWindowScheduler, batch_size=1, stale_steps=0, oversample=1.0))  # capacity 2
    newest = Driver(make(NoWindowScheduler, batch_size=1, stale_steps=0, oversample=1.0, staleness="newest"))
    for d in (oldest, newest):
        assert d.dispatch_all() == ["g0", "g1"]
        d.finish("g0")
        d.select()
        d.step()
        d.finish("g1", [0, 1])  # partial rollout: started under version 0, finished under 1
    assert oldest.evict() == ["g1"] and oldest.select() is None
    assert newest.evict() == [] and newest.select() == ["g1"]


def test_no_window_trainable_fill_starts_only_what_the_open_steps_can_train():
    capacity = Driver(make(NoWindowScheduler, batch_size=2, stale_steps=1))
    trainable = Driver(make(NoWindowScheduler, batch_size=2, stale_steps=1, fill="trainable"))
    for d in (capacity, trainable):
        assert len(d.dispatch_all()) == 4  # before the step at 0 takes its batch: steps 0 and 1
        for gid in ("g0", "g1", "g2", "g3"):
            d.finish(gid)
        assert d.select() == ["g0", "g1"]
    # the step at 0 took its batch: a group started now can only be trained by the step at 1,
    # which g2 and g3 fill already; "capacity" starts two more, which could only train at 2 (stale)
    assert capacity.dispatch_all() == ["g4", "g5"]
    assert trainable.dispatch_all() == []
    trainable.step()  # version 1: steps 1 and 2 are open
    assert trainable.dispatch_all() == ["g4", "g5"]
    with pytest.raises(ValueError, match="fill: unknown mode 'full'"):
        make(NoWindowScheduler, batch_size=2, fill="full")


def test_no_window_ahead_fill_starts_new_groups_beside_generations_that_outlived_an_update():
    trainable = Driver(make(NoWindowScheduler, batch_size=2, stale_steps=1, staleness="newest", fill="trainable"))
    ahead = Driver(make(NoWindowScheduler, batch_size=2, stale_steps=1, staleness="newest", fill="ahead"))
    for d in (trainable, ahead):
        assert d.dispatch_all() == ["g0", "g1", "g2", "g3"]
        d.finish("g0")
        d.finish("g1")
        assert d.select() == ["g0", "g1"]
        d.step()  # version 1; g2 and g3 still generating, started under version 0
        assert d.dispatch_all() == ["g4", "g5"]  # capacity 4
        d.finish("g3", [0, 1])
        d.finish("g4", 1)
        assert d.select() == ["g3", "g4"]
    # the step at 1 took its batch: only the step at 2 (2 places) can train a group started now;
    # g5 holds one, and g2, generating since version 0, the other, except with "ahead"
    assert trainable.dispatch_all() == []
    assert ahead.dispatch_all() == ["g6"]


# ------------------------------------------------------------------------ windowed strategies


@pytest.mark.parametrize("cls", [WindowGatedScheduler, WindowedFifoScheduler])
def test_window_gate_stops_stale_steps_ahead(cls):
    d = Driver(make(cls, batch_size=2, stale_steps=1))
    ids = d.dispatch_all()
    assert [d.s.deadline_of(g) for g in ids] == [0, 0, 1, 1]
    assert not d.s.can_dispatch(0, 0, 0)  # counts aside, the window is full
    with pytest.raises(RuntimeError, match="can_dispatch"):
        d.s.on_dispatch("extra", 0)
    for g in ids[:2]:
        d.finish(g)
    d.select()
    d.step()
    assert [d.s.deadline_of(g) for g in d.dispatch_all()] == [2, 2]


def test_window_gated_fills_a_short_step_in_completion_order():
    d = Driver(make(WindowGatedScheduler, batch_size=2, stale_steps=1))
    d.dispatch_all()  # g0, g1 due at 0; g2, g3 due at 1
    d.discard("g1")  # filtered out; the controller has not dispatched a replacement yet
    d.finish("g3")
    d.finish("g0")
    d.finish("g2")
    assert d.select() == ["g0", "g3"]  # the one group due now, then the first other group to finish
    assert d.dispatch_all() == []  # slot 1 holds g2 and the trained g3; slot 2 opens at version 1
    d.step()
    assert [d.s.deadline_of(g) for g in d.dispatch_all()] == [2, 2]
    assert d.select() is None  # g2 is due but only one group is ready
    d.finish("g5", 1)
    assert d.select() == ["g2", "g5"]
    assert d.s.metrics()["rollout/staleness_max"] == 1.0


def test_window_gated_due_group_always_trained_before_its_deadline():
    d = Driver(make(WindowGatedScheduler, batch_size=2, stale_steps=1))
    d.dispatch_all()  # g0,g1 -> 0; g2,g3 -> 1
    d.finish("g2")
    d.finish("g3")
    assert d.select() is None  # g0, g1 are due now and still generating
    d.finish("g0")
    assert d.select() is None
    d.finish("g1")
    assert d.select() == ["g0", "g1"]  # due groups first, even though g2, g3 finished earlier


def test_windowed_fifo_trains_oldest_first():
    d = Driver(make(WindowedFifoScheduler, batch_size=2, stale_steps=2))
    d.dispatch_all()  # g0..g5
    for g in ("g5", "g4", "g3", "g2", "g0"):
        d.finish(g)
    assert d.select() is None  # g1 is among the two oldest and still generating
    d.finish("g1")
    assert d.select() == ["g0", "g1"]
    d.step()
    d.dispatch_all()
    assert d.select() == ["g2", "g3"]


def test_windowed_fifo_refill_goes_to_the_freed_slot():
    d = Driver(make(WindowedFifoScheduler, batch_size=2, stale_steps=1))
    d.dispatch_all()  # g0, g1 -> 0; g2, g3 -> 1
    d.discard("g0")
    (refill,) = d.dispatch_all()
    assert d.s.deadline_of(refill) == 0
    for g in ("g1", "g2", "g3", refill):
        d.finish(g)
    assert d.select() == ["g1", refill]  # ordered by deadline, then dispatch order


def test_window_gated_oversampling_takes_the_first_finished_and_aborts_the_rest():
    d = Driver(make(WindowGatedScheduler, batch_size=2, stale_steps=0, oversample=0.5))  # 3 per step
    assert d.dispatch_all() == ["g0", "g1", "g2"]
    d.finish("g2")
    d.finish("g0")
    assert d.s.to_abort(0) == []
    assert d.select() == ["g2", "g0"]
    assert d.s.to_abort(0) == ["g1"]  # can no longer be trained within the bound
    d.discard("g1")
    d.step()
    assert d.s.metrics()["rollout/dropped_surplus"] == 0.0  # aborted, not evicted
    assert d.dispatch_all() == ["g3", "g4", "g5"]


# ------------------------------------------------------------------------ controller mistakes


@pytest.mark.parametrize("cls", ALL)
def test_controller_mistakes_raise_clear_errors(cls):
    d = Driver(make(cls, batch_size=1, stale_steps=1))
    (g0, *_) = d.dispatch_all()
    with pytest.raises(ValueError, match="already live"):
        d.s.on_dispatch(g0, 0)
    with pytest.raises(ValueError, match="not in flight"):
        d.s.on_complete(group("stranger", 0))
    with pytest.raises(ValueError, match="newer than the trainer version"):
        d.s.on_complete(group(g0, 3))
    with pytest.raises(ValueError, match="does not know as finished"):
        d.s.select([group(g0, 0)], 0)
    g = d.finish(g0)
    with pytest.raises(ValueError, match="not in flight"):
        d.s.on_complete(g)
    with pytest.raises(ValueError, match="not in the buffer"):
        d.s.select([], 0)
    with pytest.raises(ValueError, match="twice"):
        d.s.select([g, g], 0)
    with pytest.raises(ValueError, match="batch_size 2"):
        d.s.select(d.buffer, 0, 2)
    with pytest.raises(ValueError, match="scheduler is at version 0"):
        d.s.can_dispatch(0, 0, 1)
    with pytest.raises(RuntimeError, match="no batch was selected"):
        d.s.on_train_step(1)
    assert d.select() == [g0]
    with pytest.raises(RuntimeError, match="already taken"):
        d.s.select(d.buffer, 0)
    with pytest.raises(ValueError, match="must be 1"):
        d.s.on_train_step(2)
    with pytest.raises(ValueError, match="not live"):
        d.s.on_discard(g0)
    d.step()
    assert d.s.can_dispatch(len(d.in_flight), 0, 1)
    d.s.on_dispatch(g0, 1)  # an id may be dispatched again once its group is gone (a re-queued prompt)
    assert d.s.deadline_of(g0) in (None, 1, 2)


# ------------------------------------------------------------------------ metrics


def test_metrics_report_the_last_batch_and_per_step_drops():
    d = Driver(make(NoWindowScheduler, batch_size=2, stale_steps=1))
    d.dispatch_all()  # g0..g3 at version 0
    d.finish("g0")
    d.finish("g1")
    d.select()
    d.step()
    d.finish("g2", [0, 1])
    d.dispatch_all()
    d.finish("g4")
    assert d.select() == ["g2", "g4"]
    d.step()  # version 2; g3 still generating since version 0
    d.finish("g3", 0)
    assert d.evict() == ["g3"]
    m = d.s.metrics()
    assert m["rollout/staleness_mean"] == pytest.approx(0.5)  # g2: 1 (oldest token), g4: 0
    assert m["rollout/staleness_max"] == 1.0 and m["rollout/staleness_min"] == 0.0
    assert m["rollout/staleness_token_mean"] == pytest.approx(1 / 3)  # tokens of g2 (1, 0) and g4 (0)
    assert m["rollout/dropped_stale"] == 0.0  # frozen at the last on_train_step
    assert m["rollout/dropped_stale_total"] == 1.0
    assert m["rollout/pipeline_buf_size"] == len(d.buffer)
    assert m["rollout/pipeline_in_flight"] == len(d.in_flight)
    assert m["rollout/trained_total"] == 4.0 and m["rollout/dispatched_total"] == 6.0
    d.dispatch_all()
    d.finish("g6", 2)
    d.finish("g7", 2)
    d.select()
    d.step()
    assert d.s.metrics()["rollout/dropped_stale"] == 1.0  # the drop is reported with the step it happened in
