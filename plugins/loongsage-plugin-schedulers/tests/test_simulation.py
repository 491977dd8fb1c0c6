"""Every strategy driven through the simulated pipeline of ``conftest.py`` (heavy-tailed generation
times, filter discards, weight updates with partial rollout), checking what an outside observer
can check: the staleness of every trained group (from its tokens), drops, capacity, FIFO order,
oversampling, and the trainer's idle time. Hypothesis draws the pipeline parameters; runs are
derandomized so the suite is deterministic."""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loongsage_plugin_schedulers import (
    NoWindowScheduler,
    SyncScheduler,
    WindowedFifoScheduler,
    WindowGatedScheduler,
)

from loongsage_hookspecs import SchedulerContext


def make(factory, *, batch_size, stale_steps=1, quota=None, **args):
    """``factory(ctx, **args)`` as the host builds a scheduler: its context carries ``batch_size``,
    ``stale_steps`` and ``quota``; the rest are the job's ``scheduler_args``."""
    return factory(SchedulerContext(batch_size=batch_size, stale_steps=stale_steps, quota=quota), **args)

ASYNC = [NoWindowScheduler, WindowGatedScheduler, WindowedFifoScheduler]
WINDOWED = [WindowGatedScheduler, WindowedFifoScheduler]
STEPS = 100  # per drawn pipeline; x EXAMPLES draws = thousands of steps per strategy
EXAMPLES = 25

SIM_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@st.composite
def pipelines(draw, cfg_cls, *, oversample=None, discard=None):
    """Random pipeline parameters: batch size, bound, oversampling, Pareto tail, timings, filters,
    engine concurrency, and whether the controller aborts what ``to_abort`` lists."""
    return cfg_cls(
        batch_size=draw(st.integers(1, 6)),
        stale_steps=draw(st.integers(0, 3)),
        oversample=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])) if oversample is None else oversample,
        steps=STEPS,
        seed=draw(st.integers(0, 2**20)),
        alpha=draw(st.floats(1.1, 3.0)),
        mean_duration=draw(st.floats(0.1, 3.0)),
        train_time=draw(st.floats(0.05, 2.0)),
        update_time=draw(st.floats(0.0, 0.5)),
        discard_prob=draw(st.sampled_from([0.0, 0.1, 0.3])) if discard is None else discard,
        engine_slots=draw(st.sampled_from([None, 1, 3])),
        abort_doomed=draw(st.booleans()),
    )


def check_common(res, cfg, sched_cls):
    """Invariants every strategy must keep in every run."""
    assert len(res.batches) == cfg.steps
    assert all(len(b) == cfg.batch_size for b in res.batches)
    trained = [i for b in res.batches for i in b]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert not set(trained) & {d[0] for d in res.dropped}, "a dropped group was trained"
    assert res.max_occupancy <= res.capacity
    # The scheduler's own staleness metrics agree with the model's token-level measurement.
    for step, m in enumerate(res.metrics):
        assert m["rollout/staleness_max"] == max(res.staleness[step])
        assert m["rollout/staleness_mean"] == pytest.approx(sum(res.staleness[step]) / cfg.batch_size)


@pytest.mark.parametrize("sched_cls", ASYNC, ids=lambda c: c.name)
@SIM_SETTINGS
@given(data=st.data())
def test_async_staleness_never_exceeds_the_bound(sim, sim_config, sched_cls, data):
    cfg = data.draw(pipelines(sim_config))
    res = sim(sched_cls, cfg)
    check_common(res, cfg, sched_cls)
    assert max(res.all_staleness) <= cfg.stale_steps
    if sched_cls is NoWindowScheduler:
        # Drops only groups that were already too stale when dropped.
        assert all(staleness > cfg.stale_steps for _, _, staleness in res.dropped)
        assert res.metrics[-1]["rollout/dropped_surplus_total"] == 0
    else:
        # Windowed strategies never drop for staleness; they give up only oversampling surplus.
        assert res.metrics[-1]["rollout/dropped_stale_total"] == 0
        if cfg.oversample == 0:
            assert res.dropped == [] and res.aborted == 0
    if sched_cls is WindowedFifoScheduler:
        trained = [i for b in res.batches for i in b]
        keys = [(res.deadline[i], i) for i in trained]
        assert keys == sorted(keys), "windowed_fifo trained out of (deadline, dispatch) order"


@SIM_SETTINGS
@given(data=st.data())
def test_sync_never_trains_stale_data(sim, sim_config, data):
    cfg = data.draw(pipelines(sim_config))
    res = sim(SyncScheduler, cfg)
    check_common(res, cfg, SyncScheduler)
    assert set(res.all_staleness) == {0}
    assert all(staleness == 0 for _, _, staleness in res.dropped)  # only oversampling surplus
    trained = [i for b in res.batches for i in b]
    assert trained == sorted(trained)  # one round at a time, dispatch order
    assert res.max_occupancy <= make(SyncScheduler, batch_size=cfg.batch_size, oversample=cfg.oversample).per_step


@pytest.mark.parametrize("sched_cls", WINDOWED, ids=lambda c: c.name)
def test_windowed_never_drop_over_thousands_of_steps_with_filters(sim, sim_config, sched_cls):
    cfg = sim_config(batch_size=8, stale_steps=2, steps=1000, alpha=1.3, discard_prob=0.2, seed=7)
    res = sim(sched_cls, cfg)
    assert (res.dropped, res.aborted) == ([], 0)
    assert max(res.all_staleness) == 2  # the bound is reached, never passed
    assert res.discarded > 0


def test_windowed_fifo_trains_in_dispatch_order_without_filters(sim, sim_config):
    res = sim(WindowedFifoScheduler, sim_config(batch_size=4, stale_steps=2, steps=500, alpha=1.2, seed=3))
    trained = [i for b in res.batches for i in b]
    assert trained == list(range(len(trained)))


@pytest.mark.parametrize("oversample", [0.0, 0.25, 0.5])
@pytest.mark.parametrize("sched_cls", [SyncScheduler, WindowGatedScheduler, WindowedFifoScheduler, NoWindowScheduler],
                         ids=lambda c: getattr(c, "name", c))
def test_oversampling_dispatches_the_expected_extra(sim, sim_config, sched_cls, oversample):
    cfg = sim_config(batch_size=8, stale_steps=1, oversample=oversample, steps=200, seed=11)
    res = sim(sched_cls, cfg)
    extra = {0.0: 0, 0.25: 2, 0.5: 4}[oversample]  # ceil(8 * oversample)
    per_step = 8 + extra
    if sched_cls is SyncScheduler:
        assert all(res.per_version[v] == per_step for v in range(cfg.steps))
        assert res.metrics[-1]["rollout/dropped_surplus_total"] == extra * cfg.steps
    elif sched_cls is NoWindowScheduler:
        assert res.full_after_pump and res.max_occupancy == per_step * 2
    else:
        assert all(res.per_deadline[v] == per_step for v in range(cfg.steps))
    assert res.dispatched >= per_step * cfg.steps


def test_runs_are_deterministic(sim, sim_config):
    cfg = sim_config(batch_size=3, stale_steps=1, oversample=0.5, steps=150, discard_prob=0.2, seed=5)
    for cls in (SyncScheduler, *ASYNC):
        a, b = sim(cls, cfg), sim(cls, cfg)
        assert (a.batches, a.dropped, a.total_time) == (b.batches, b.dropped, b.total_time)


IDLE_STEPS = int(os.environ.get("SCHEDULERS_IDLE_STEPS", "300"))  # raise it for tighter numbers

IDLE_CASES = [
    ("sync", SyncScheduler, 0, 0.0),
    ("no_window s=1", NoWindowScheduler, 1, 0.0),
    ("window_gated s=1", WindowGatedScheduler, 1, 0.0),
    ("windowed_fifo s=1", WindowedFifoScheduler, 1, 0.0),
    ("no_window s=2", NoWindowScheduler, 2, 0.0),
    ("window_gated s=2", WindowGatedScheduler, 2, 0.0),
    ("windowed_fifo s=2", WindowedFifoScheduler, 2, 0.0),
    ("sync o=0.25", SyncScheduler, 0, 0.25),
    ("window_gated s=1 o=0.25", WindowGatedScheduler, 1, 0.25),
    ("windowed_fifo s=1 o=0.25", WindowedFifoScheduler, 1, 0.25),
    ("no_window s=1 trainable", functools.partial(NoWindowScheduler, fill="trainable"), 1, 0.0),
    ("no_window s=1 trainable newest", functools.partial(NoWindowScheduler, fill="trainable", staleness="newest"),
     1, 0.0),
    ("no_window s=1 newest", functools.partial(NoWindowScheduler, staleness="newest"), 1, 0.0),
    ("no_window s=1 ahead newest", functools.partial(NoWindowScheduler, fill="ahead", staleness="newest"), 1, 0.0),
]


def idle_table(sim, sim_config, alpha: float) -> dict[str, tuple[float, float, int]]:
    """``name -> (trainer idle fraction, mean staleness, groups dropped)`` for the model pipeline:
    8 groups per step, generation mean 1.0 (Pareto ``alpha``), training 1.0, weight update 0.1."""
    out = {}
    for name, cls, s, o in IDLE_CASES:
        res = sim(cls, sim_config(batch_size=8, stale_steps=s, oversample=o, steps=IDLE_STEPS, alpha=alpha,
                                  mean_duration=1.0, train_time=1.0, update_time=0.1, seed=2024))
        stale = res.all_staleness
        out[name] = (res.idle_fraction, sum(stale) / len(stale), len(res.dropped) + res.aborted)
    return out


@pytest.mark.parametrize("alpha", [1.5, 3.0])
def test_async_schedulers_idle_the_trainer_less_than_sync(sim, sim_config, alpha, capsys):
    table = idle_table(sim, sim_config, alpha)
    with capsys.disabled():
        print(f"\ntrainer idle fraction, Pareto alpha={alpha} (idle, mean staleness, dropped+aborted)")
        for name, (idle, stale, dropped) in table.items():
            print(f"  {name:32s} {idle:6.3f} {stale:5.2f} {dropped:6d}")
    sync_idle = table["sync"][0]
    for name, (idle, _, _) in table.items():
        if name != "sync" and "o=" not in name:
            assert idle < sync_idle, name
    # A larger window never makes the trainer wait more, and dropping stragglers waits least.
    for kind in ("no_window", "window_gated", "windowed_fifo"):
        assert table[f"{kind} s=2"][0] <= table[f"{kind} s=1"][0]
    assert table["no_window s=1"][0] <= min(table["window_gated s=1"][0], table["windowed_fifo s=1"][0])
    # Oversampling lets window_gated take the first groups to finish instead of waiting for the slowest.
    assert table["window_gated s=1 o=0.25"][0] < table["window_gated s=1"][0]


@pytest.mark.parametrize("alpha", [1.5, 3.0])
def test_partial_rollout_no_window_trains_every_group_within_the_bound(sim, sim_config, alpha):
    # no_window with partial rollout (staleness by the newest token) and the trainable fill: every
    # generated group is trained within one version of its last token, none is dropped, and the
    # trainer waits less than with the windows, which hold each group to its dispatch version
    cfg = sim_config(batch_size=8, stale_steps=1, steps=IDLE_STEPS, alpha=alpha, mean_duration=1.0,
                     train_time=1.0, update_time=0.1, seed=2024)
    partial = functools.partial(NoWindowScheduler, staleness="newest", fill="trainable")
    res = sim(partial, cfg)
    assert res.dropped == [] and res.aborted == 0
    assert max(m["rollout/staleness_max"] for m in res.metrics) == 1.0  # by the newest token
    assert res.dispatched - sum(map(len, res.batches)) <= res.capacity  # the rest: still live at the end
    filled = sim(functools.partial(NoWindowScheduler, staleness="newest"), cfg)
    assert len(filled.dropped) > 0  # the capacity fill makes groups that can only train too late
    assert res.idle_fraction < sim(WindowedFifoScheduler, cfg).idle_fraction
    # the ahead fill waits less still, for a few groups that finish together beyond the places
    ahead = sim(functools.partial(NoWindowScheduler, staleness="newest", fill="ahead"), cfg)
    assert ahead.idle_fraction < res.idle_fraction
    assert 0 < len(ahead.dropped) + ahead.aborted <= 0.05 * ahead.dispatched
