"""A small discrete-event model of the asynchronous pipeline, to test schedulers against.

The model (a fake clock, no threads):

* Engines generate every dispatched group in parallel (or at most ``engine_slots`` at once, the
  rest queued FIFO). A group needs ``duration`` seconds of generation, drawn from a Pareto
  distribution (heavy tail); its ``tokens`` generated tokens are spread evenly over that time.
* The trainer takes a batch, trains for ``train_time``, then pushes weights for ``update_time``
  while the engines pause (partial rollout: generation resumes afterwards under the new weights,
  so a trajectory can mix versions). Then the version increases and ``on_train_step`` is called.
* A finished group is discarded with probability ``discard_prob`` (a filter) or buffered.
* The controller loop is the one documented on ``loongsage_hookspecs.Scheduler``: abort what
  ``to_abort`` lists, remove what ``evict`` returns, ``select``, dispatch while ``can_dispatch``.

Engine time is kept as a virtual clock that stops during weight updates, so the weight version of
a token is the number of updates whose pause began before the token's virtual time.

Every token's weight version is computed by the model, independently of any scheduler, and the
result records what an external observer sees: which groups each step trained, their staleness
(``version - oldest generated token``), the groups dropped, pipeline occupancy and trainer idle
time. The model checks at every dispatch that occupancy stays within capacity, and fails on a
deadlock (no event left before the requested number of steps).
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

from loongsage_hookspecs import SchedulerContext, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus


def make(factory, *, batch_size, stale_steps=1, quota=None, **args):
    """``factory(ctx, **args)`` as the host builds a scheduler: its context carries ``batch_size``,
    ``stale_steps`` and ``quota``; the rest are the job's ``scheduler_args``."""
    return factory(SchedulerContext(batch_size=batch_size, stale_steps=stale_steps, quota=quota), **args)


@dataclass(frozen=True)
class SimConfig:
    batch_size: int = 4
    stale_steps: int = 1
    oversample: float = 0.0
    steps: int = 100
    seed: int = 0
    alpha: float = 1.5  # Pareto shape: smaller is heavier-tailed (infinite variance below 2)
    mean_duration: float = 1.0
    train_time: float = 0.5
    update_time: float = 0.05
    discard_prob: float = 0.0
    engine_slots: int | None = None
    tokens: int = 4
    abort_doomed: bool = True


@dataclass
class SimResult:
    capacity: int = 0
    batches: list[list[int]] = field(default_factory=list)  # dispatch indices trained, per step
    staleness: list[list[int]] = field(default_factory=list)  # oldest-token staleness, per step
    dropped: list[tuple[int, int, int]] = field(default_factory=list)  # (dispatch index, version, staleness)
    aborted: int = 0
    discarded: int = 0
    dispatched: int = 0
    per_deadline: Counter = field(default_factory=Counter)  # deadline -> groups dispatched for it
    deadline: dict[int, int | None] = field(default_factory=dict)  # dispatch index -> deadline
    per_version: Counter = field(default_factory=Counter)  # dispatch version -> groups dispatched
    max_occupancy: int = 0
    full_after_pump: bool = True  # occupancy == capacity after every dispatch loop
    metrics: list[dict[str, float]] = field(default_factory=list)
    idle_time: float = 0.0
    total_time: float = 0.0

    @property
    def idle_fraction(self) -> float:
        return self.idle_time / self.total_time if self.total_time else 0.0

    @property
    def all_staleness(self) -> list[int]:
        return [s for step in self.staleness for s in step]


def index_of(group: TrajectoryGroup) -> int:
    """Dispatch index of a simulated group (its id is ``g<index>``)."""
    return int(group.group_id[1:])


def oldest_staleness(group: TrajectoryGroup, version: int) -> int:
    """The model's own staleness measure: version minus the oldest generated token's version."""
    vs = [v for t in group.trajectories for s in t.segments for v in s.weight_versions if v >= 0]
    return version - min(vs) if vs else 0


class _Pipeline:
    """State of one simulated run."""

    def __init__(self, factory: Callable[..., Any], cfg: SimConfig) -> None:
        self.cfg = cfg
        self.sched = make(factory, batch_size=cfg.batch_size, stale_steps=cfg.stale_steps, oversample=cfg.oversample)
        self.durations = random.Random(cfg.seed)
        self.filter_rng = random.Random(cfg.seed + 1_000_003)
        self.res = SimResult(capacity=self.sched.capacity)
        self.now = 0.0
        self.virtual = 0.0  # engine clock: stops while paused for a weight update
        self.paused = False
        self.update_vtimes: list[float] = []  # engine time at which each weight update paused generation
        self.version = 0
        self.trainer = "idle"  # idle | train | update
        self.trainer_until = 0.0
        self.running: list[tuple[float, int, str]] = []  # heap of (virtual end, dispatch index, gid)
        self.waiting: deque[str] = deque()
        self.info: dict[str, dict[str, Any]] = {}  # live gid -> start, duration, index
        self.buffer: list[TrajectoryGroup] = []
        self.next_index = 0

    # -- engines -----------------------------------------------------------------------------

    def _duration(self) -> float:
        a = self.cfg.alpha
        scale = self.cfg.mean_duration * (a - 1) / a  # Pareto mean = scale * a / (a - 1)
        return scale * self.durations.paretovariate(a)

    def _start(self, gid: str) -> None:
        info = self.info[gid]
        info["start"] = self.virtual
        heapq.heappush(self.running, (self.virtual + info["duration"], info["index"], gid))

    def _fill_engines(self) -> None:
        limit = self.cfg.engine_slots
        while self.waiting and (limit is None or len(self.running) < limit):
            self._start(self.waiting.popleft())

    def _version_at(self, vtime: float) -> int:
        return bisect.bisect_left(self.update_vtimes, vtime)

    def _finish(self, gid: str) -> None:
        info = self.info.pop(gid)
        n = self.cfg.tokens
        seg = Segment()
        seg.append([1, 2], generated=False)
        versions = [self._version_at(info["start"] + (i + 1) / n * info["duration"]) for i in range(n)]
        seg.append(list(range(3, 3 + n)), generated=True, logprobs=[-0.5] * n, weight_version=versions)
        traj = Trajectory(id=f"{gid}-0", prompt_id=gid, group_id=gid, segments=[seg],
                          status=TrajectoryStatus.COMPLETED)
        group = TrajectoryGroup(group_id=gid, prompt_id=gid, trajectories=[traj])
        if self.filter_rng.random() < self.cfg.discard_prob:
            self.sched.on_discard(gid)
            self.res.discarded += 1
        else:
            self.sched.on_complete(group)
            self.buffer.append(group)

    def _abort(self, gid: str) -> None:
        self.info.pop(gid)
        self.running = [e for e in self.running if e[2] != gid]
        heapq.heapify(self.running)
        if gid in self.waiting:
            self.waiting.remove(gid)
        self.sched.on_discard(gid)
        self.res.aborted += 1

    # -- controller --------------------------------------------------------------------------

    def _clean(self) -> None:
        if self.cfg.abort_doomed:
            for gid in self.sched.to_abort(self.version):
                self._abort(gid)
        for g in self.sched.evict(self.buffer, self.version):
            self.buffer.remove(g)
            self.res.dropped.append((index_of(g), self.version, oldest_staleness(g, self.version)))

    def pump(self) -> None:
        self._clean()
        if self.trainer == "idle":
            batch = self.sched.select(self.buffer, self.version, self.cfg.batch_size)
            if batch is not None:
                for g in batch:
                    self.buffer.remove(g)
                self.res.batches.append([index_of(g) for g in batch])
                self.res.staleness.append([oldest_staleness(g, self.version) for g in batch])
                self.trainer = "train"
                self.trainer_until = self.now + self.cfg.train_time
                self._clean()
        count = 0
        while self.sched.can_dispatch(len(self.info), len(self.buffer), self.version):
            gid = f"g{self.next_index}"
            self.sched.on_dispatch(gid, self.version)
            self.info[gid] = {"duration": self._duration(), "index": self.next_index}
            self.res.per_deadline[self.sched.deadline_of(gid)] += 1
            self.res.deadline[self.next_index] = self.sched.deadline_of(gid)
            self.res.per_version[self.version] += 1
            self.next_index += 1
            self.res.dispatched += 1
            self.waiting.append(gid)
            occupancy = len(self.info) + len(self.buffer)
            assert occupancy <= self.sched.capacity, f"occupancy {occupancy} > capacity {self.sched.capacity}"
            self.res.max_occupancy = max(self.res.max_occupancy, occupancy)
            count += 1
            assert count <= self.sched.capacity, "can_dispatch never said no"
        self._fill_engines()
        if len(self.info) + len(self.buffer) != self.sched.capacity:
            self.res.full_after_pump = False

    # -- clock -------------------------------------------------------------------------------

    def _advance(self, to: float) -> None:
        dt = to - self.now
        if self.trainer == "idle":
            self.res.idle_time += dt
        if not self.paused:
            self.virtual += dt
        self.now = to

    def _next_completion(self) -> float | None:
        while self.running and self.running[0][2] not in self.info:
            heapq.heappop(self.running)
        if not self.running:
            return None
        left = max(0.0, self.running[0][0] - self.virtual)
        return (self.trainer_until if self.paused else self.now) + left

    def run(self) -> SimResult:
        events = 0
        while self.version < self.cfg.steps:
            self.pump()
            candidates = [t for t in (self._next_completion(),
                                      self.trainer_until if self.trainer != "idle" else None) if t is not None]
            assert candidates, f"deadlock at version {self.version}: nothing in flight, trainer waiting"
            events += 1
            assert events < 200 * (self.cfg.steps + 10) * (self.sched.capacity + 2), "simulation does not progress"
            t_next = min(candidates)
            self._advance(t_next)
            if self.trainer != "idle" and self.trainer_until <= t_next:
                self._trainer_event()
            while self.running and (self.running[0][2] not in self.info or self.running[0][0] <= self.virtual + 1e-12):
                _, _, gid = heapq.heappop(self.running)
                if gid in self.info:
                    self._finish(gid)
            self._fill_engines()
        self.res.total_time = self.now
        return self.res

    def _trainer_event(self) -> None:
        if self.trainer == "train":
            self.trainer = "update"
            self.paused = True
            self.update_vtimes.append(self.virtual)
            self.trainer_until = self.now + self.cfg.update_time
        if self.trainer == "update" and self.trainer_until <= self.now:
            self.paused = False
            self.version += 1
            self.sched.on_train_step(self.version)
            self.res.metrics.append(self.sched.metrics())
            self.trainer = "idle"


def simulate(factory: Callable[..., Any], cfg: SimConfig) -> SimResult:
    """Run ``cfg.steps`` train steps of the model with the scheduler ``factory`` builds."""
    return _Pipeline(factory, cfg).run()


@pytest.fixture(scope="session")
def sim() -> Callable[[Callable[..., Any], SimConfig], SimResult]:
    return simulate


@pytest.fixture(scope="session")
def sim_config() -> type[SimConfig]:
    return SimConfig
