"""Creating the model actors on a local (or given) Ray cluster, in a Ray placement group.

``placement.colocate = true``: trainer rank ``i`` and engine ``i`` share one actor (one process,
one set of devices; weights move in-process). ``false``: trainer ranks and engines are separate
actors with their own CPU/GPU reservations, and weights move between processes.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import attrs

from loongsage_hookspecs import EngineRouterContext

from ..algorithms.distill import runs_teachers
from ..config import ConfigError, JobConfig, component_ref
from .actors import ModelActor
from .resource_errors import ray_start_error

log = logging.getLogger("loongsage")


def required_resources(job: JobConfig) -> dict[str, float]:
    """CPUs, GPUs and custom resources (``placement.*_resources``) the job's actors reserve (the
    trainer ranks, the separate engines and, when the job distils, the teacher actor)."""
    pl = job.placement
    trainers = job.train.num_workers
    engines = 0 if pl.colocate else job.rollout.num_engines
    teachers = int(runs_teachers(job))
    need = {"CPU": trainers * pl.trainer_cpus + engines * pl.engine_cpus + teachers * pl.teacher_cpus,
            "GPU": trainers * pl.trainer_gpus + engines * pl.engine_gpus + teachers * pl.teacher_gpus}
    for count, custom in ((trainers, pl.trainer_resources), (engines, pl.engine_resources),
                          (teachers, pl.teacher_resources)):
        for name, amount in custom.items() if count else ():
            need[name] = need.get(name, 0.0) + count * float(amount)
    return need


def check_resources(job: JobConfig) -> None:
    """Fail fast, naming the keys, when the cluster cannot hold every actor (they would wait forever)."""
    import ray

    need = required_resources(job)
    have = ray.cluster_resources()
    for res, amount in need.items():
        if amount > have.get(res, 0.0) + 1e-9:
            if res in ("CPU", "GPU"):
                hint = (f"lower train.num_workers / rollout.num_engines or placement.*_{res.lower()}s "
                        "(or start a bigger cluster: run.ray_num_cpus)")
            else:
                hint = (f"placement.trainer_resources / engine_resources / teacher_resources ask for it; give "
                        f"nodes that resource (ray start --resources '{{\"{res}\": N}}') or change those keys")
            raise ConfigError(f"{job.source_path or '<job>'}: the actors need {amount:g} {res} but the Ray cluster "
                              f"has {have.get(res, 0.0):g}; {hint}")


def bind_ray_to_loopback() -> None:
    """Make the next local Ray cluster listen on 127.0.0.1 only.

    ``ray.init(_node_ip_address="127.0.0.1")`` is not enough: Ray swaps a loopback address for the
    machine's routable one, and its GCS, raylet and worker servers then bind every interface. Ray
    keeps them on loopback when it believes clusters are unsupported on this platform
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read at ``import ray``, so the constant is set too).
    Ray's token authentication guards those ports only when enabled (``RAY_AUTH_MODE=token``; Ray
    2.60 leaves it off by default), so the loopback binding is what keeps them local.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # inherited by Ray's processes
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - Ray reorganised: the environment variable still applies
        return
    ray_constants.ENABLE_RAY_CLUSTER = False


def keep_workers_at_driver_priority() -> None:
    """Start the next local Ray cluster's workers at the driver's CPU priority.

    Ray starts worker processes at niceness 15 (``RAY_worker_niceness``, read by the raylet) to
    keep its own daemons responsive. Here the workers are the run itself (trainer ranks, engines):
    at niceness 15 they would wait behind the driver's router and agents and behind any other
    busy process of the machine, so a loaded CPU machine would stall the step. A value the user
    set is kept.
    """
    os.environ.setdefault("RAY_worker_niceness", "0")


def quiet_tokenizers_in_workers() -> None:
    """Start the next local Ray cluster's workers with ``TOKENIZERS_PARALLELISM=false``.

    An actor that loaded a fast tokenizer and then forks (a sandbox, an agent program) would
    otherwise have Hugging Face ``tokenizers`` warn, and disable its threads, in every child. Ray's
    workers inherit the raylet's environment, which is this process's at ``ray.init``, so setting it
    here reaches every worker. A job ``runtime_env`` would too, but then no actor can take one of
    the idle workers Ray starts with the cluster (one per CPU, without that environment): each
    actor waits for a new interpreter to start and import Ray (measured: first call 1.04 s against
    0.37 s) while the idle ones are left unused. The driver keeps it too (it forks agents and
    sandboxes as well). A value the user set is kept.
    """
    for name, value in WORKER_ENV_VARS.items():
        os.environ.setdefault(name, value)


WORKER_ENV_VARS = {"TOKENIZERS_PARALLELISM": "false"}
"""The environment every worker of a run gets: through the driver's environment on a local cluster
(:func:`quiet_tokenizers_in_workers`), through the job's ``runtime_env`` on an existing one."""


def init_ray(job: JobConfig) -> None:
    """Start (or join) the Ray cluster: one node on loopback, capped object store, no dashboard
    unless ``run.ray_dashboard`` asks for one (then on loopback too). ``run.ray_address`` (else the
    ``RAY_ADDRESS`` environment variable) joins an existing cluster instead, e.g. a multi-node one
    started with ``ray start --head`` / ``ray start --address``.

    A local cluster gets at least as many logical CPUs as the actors reserve: on a small machine
    the trainer and the engines then share the cores instead of waiting for each other.

    A cluster that does not start, or an address where none answers (tried with a plain TCP
    connection first: Ray itself keeps retrying for minutes), is a one-line
    :class:`~.resource_errors.RayStartError` saying what to check.
    """
    import ray

    if ray.is_initialized():
        return
    address = job.run.ray_address or os.environ.get("RAY_ADDRESS")
    if address:  # an existing (possibly multi-node) cluster: its nodes already listen where they do
        try:
            check_reachable(address)
            # the job's runtime_env: the workers of other nodes inherit their own node's environment
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=True,
                     runtime_env={"env_vars": dict(WORKER_ENV_VARS)})
        except Exception as exc:
            raise ray_start_error(exc, address) from None
        return
    cpus = job.run.ray_num_cpus or max(os.cpu_count() or 1, int(required_resources(job)["CPU"] + 0.999))
    start_local_cluster(num_cpus=cpus, object_store_mb=job.run.ray_object_store_mb,
                        dashboard=bool(job.run.ray_dashboard), log_to_driver=True)


def start_local_cluster(*, num_cpus: int, object_store_mb: int, dashboard: bool = False,
                        log_to_driver: bool = False) -> None:
    """Start a one-node Ray cluster of this machine: loopback only (:func:`bind_ray_to_loopback`),
    workers at the driver's priority (:func:`keep_workers_at_driver_priority`), their environment
    set here rather than in a job ``runtime_env`` (:func:`quiet_tokenizers_in_workers`);
    ``num_cpus`` logical CPUs, an object store of ``object_store_mb`` MiB and a dashboard (on
    loopback) only when asked. The controller (:func:`init_ray`), the
    tests' clusters and the benchmarks all start theirs here, so they run on the cluster a user's
    run gets.

    Ray gives its raylet a fixed 30 s to register with the GCS; on a machine whose cores are all
    busy that can run out ("The current node timed out during startup"): what it started is
    stopped and started again, up to :data:`LOCAL_START_ATTEMPTS` times. Any other failure, or
    the last time-out, is a one-line :class:`~.resource_errors.RayStartError`.
    """
    import ray

    bind_ray_to_loopback()
    keep_workers_at_driver_priority()
    quiet_tokenizers_in_workers()
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1",
                     object_store_memory=object_store_mb * 2**20, ignore_reinit_error=True,
                     _node_ip_address="127.0.0.1", log_to_driver=log_to_driver)
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == LOCAL_START_ATTEMPTS:
                raise ray_start_error(exc, None) from None
            log.warning("the local Ray cluster did not start in time (attempt %d of %d, the machine is busy); "
                        "starting it again", attempt, LOCAL_START_ATTEMPTS)
            ray.shutdown()


LOCAL_START_ATTEMPTS = 3
"""How many times :func:`start_local_cluster` starts a local cluster whose node timed out during start-up."""

CONNECT_TIMEOUT_S = 10.0
"""How long :func:`check_reachable` waits for a Ray cluster's address to accept a connection."""


def check_reachable(address: str) -> None:
    """Fail at once (``OSError``) when nothing listens at a ``host:port`` Ray address
    (``ray://host:port`` too); ``auto`` and other forms are left to Ray."""
    target = address.split("://", 1)[-1]
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return
    with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S):
        pass


@attrs.define
class Actors:
    """Handles of the trainer ranks and engines, and the engines' base URLs."""

    trainers: list[Any]
    engine_actors: list[Any]
    engine_urls: list[str]
    colocated: bool
    placement_group: Any = None
    dp_ranks: list[int] = attrs.field(kw_only=True)
    """The data-parallel rank of each trainer actor (ranks of one model replica share one; the
    step's rows are sharded by them in :class:`.worker_group.WorkerGroup`)."""
    dp_size: int = attrs.field(kw_only=True)
    critic_bundle: int | None = attrs.field(default=None, kw_only=True)
    """Index of the first critic bundle in ``placement_group`` (``None``: the job has no critic)."""
    teacher_bundle: int | None = attrs.field(default=None, kw_only=True)
    """Index of the teacher actor's bundle in ``placement_group`` (``None``: the job distils nothing)."""

    def all(self) -> list[Any]:
        """Every distinct actor (a colocated actor is both a trainer and an engine)."""
        if self.colocated:
            return list(self.trainers)
        return self.trainers + self.engine_actors

    def shutdown(self) -> None:
        """Stop every engine server and transport, then kill the actors."""
        import ray

        for a in self.all():
            try:
                ray.get(a.shutdown.remote())
            except Exception:  # an actor that already died has nothing left to close
                pass
            ray.kill(a)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None


def _bundle(cpus: float, gpus: float, custom: dict[str, float] | None = None) -> dict[str, float]:
    bundle = {k: float(v) for k, v in (("CPU", cpus), ("GPU", gpus), *(custom or {}).items()) if v > 0}
    return bundle or {"CPU": 0.001}


def create_placement_group(job: JobConfig, with_critic: bool = False) -> Any:
    """One placement-group bundle per actor (trainer ranks first, then separate engines, then the
    critic ranks when ``with_critic``, then the teacher actor when the job distils).

    ``PACK`` keeps the bundles of one job together (one node when it fits); every bundle is a
    per-role resource request, so the same code places actors on CPU-only and GPU clusters. A
    role's custom resources (``placement.*_resources``) go into its bundles, so a role whose
    resource only some nodes have is placed on those nodes.
    """
    from ray.util.placement_group import placement_group

    pl = job.placement
    bundles = [_bundle(pl.trainer_cpus, pl.trainer_gpus, pl.trainer_resources) for _ in range(job.train.num_workers)]
    if not pl.colocate:
        bundles += [_bundle(pl.engine_cpus, pl.engine_gpus, pl.engine_resources)
                    for _ in range(job.rollout.num_engines)]
    if with_critic:
        bundles += [_bundle(job.critic.cpus, job.critic.gpus) for _ in range(job.critic.num_workers)]
    if runs_teachers(job):
        bundles.append(_bundle(pl.teacher_cpus, pl.teacher_gpus, pl.teacher_resources))
    return placement_group(bundles, strategy="PACK")


def create_actors(job: JobConfig, needs_reference: bool, secret: str | None = None,
                  with_critic: bool = False) -> Actors:
    """Reserve a placement group, start every model actor in its bundle, wait until they are ready.

    ``secret``: the run secret, required by the engines and sent by the actors' weight transports.
    ``with_critic``: the group also reserves the critic ranks' bundles (``Actors.critic_bundle``
    on), where :meth:`.critic.Critic.create` starts them (check first that the cluster holds them:
    :meth:`.critic.Critic.check_resources`). A job that distils gets the teacher actor's bundle
    last (``Actors.teacher_bundle``), where :meth:`.teacher_actor.Teachers.create` starts it.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_resources(job)  # the placement itself was checked when the job was resolved
    pg = create_placement_group(job, with_critic)
    ray.get(pg.ready())
    world = job.train.num_workers
    remote = ray.remote(ModelActor)
    pl = job.placement

    def in_bundle(index: int, cpus: float, gpus: float, custom: dict[str, float]) -> Any:
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
        resources = {k: float(v) for k, v in custom.items() if v > 0}
        return remote.options(num_cpus=cpus, num_gpus=gpus, resources=resources or None,
                              scheduling_strategy=strategy)

    trainers: list[Any] = []
    engines: list[Any] = []
    for rank in range(world):
        engine_index = rank if pl.colocate and rank < job.rollout.num_engines else None
        actor = in_bundle(rank, pl.trainer_cpus, pl.trainer_gpus, pl.trainer_resources).remote(
            job, rank, world, engine_index, needs_reference, secret)
        trainers.append(actor)
        if engine_index is not None:
            engines.append(actor)
    if not pl.colocate:
        for i in range(job.rollout.num_engines):
            engines.append(in_bundle(world + i, pl.engine_cpus, pl.engine_gpus, pl.engine_resources).remote(
                job, None, 1, i, False, secret))
    distinct = trainers + ([] if pl.colocate else engines)
    try:
        # rank 0 listens first (a port the OS assigns) and reports where; then every rank joins there
        address, port = ray.get(trainers[0].host_rendezvous.remote())
        ray.get([a.start.remote(address, port) for a in distinct])
        infos = ray.get([a.ready.remote() for a in engines])
        ranks = ray.get([a.ready.remote() for a in trainers])
    except BaseException:  # a rank that failed to start leaves no actor or reservation behind
        Actors(trainers=trainers, engine_actors=engines, engine_urls=[], colocated=pl.colocate,
               placement_group=pg, dp_ranks=[], dp_size=1).shutdown()
        raise
    first_critic = world + (0 if pl.colocate else job.rollout.num_engines)
    dp_sizes = {r["dp_size"] for r in ranks}
    if len(dp_sizes) != 1 or sorted({r["dp_rank"] for r in ranks}) != list(range(dp_sizes.pop() if dp_sizes else 1)):
        raise RuntimeError(f"trainer ranks report inconsistent data-parallel layouts: "
                           f"{[(r['dp_rank'], r['dp_size']) for r in ranks]}")
    return Actors(trainers=trainers, engine_actors=engines, engine_urls=[i["engine_url"] for i in infos],
                  colocated=pl.colocate, placement_group=pg, dp_ranks=[r["dp_rank"] for r in ranks],
                  dp_size=ranks[0]["dp_size"],
                  critic_bundle=first_critic if with_critic else None,
                  teacher_bundle=first_critic + (job.critic.num_workers if with_critic else 0)
                  if runs_teachers(job) else None)


def start_engine_router(job: JobConfig, host: Any, engine_urls: list[str],
                        secret: str | None = None) -> tuple[Any, list[str]]:
    """The job's ``[rollout] engine_router`` started in front of ``engine_urls`` (or ``None``), and
    the URLs generation requests go to: the router's one URL, or the engines themselves.
    ``secret``: the run secret the engines require (the router's context's ``api_key``)."""
    if not job.rollout.engine_router:
        return None, list(engine_urls)
    ref = component_ref(job, "rollout.engine_router")
    ctx = EngineRouterContext(where=ref.where, job=job, components=host, engine_urls=tuple(engine_urls),
                              api_key=secret)
    router = host.bind(ref, ctx)
    try:
        url = router.start()
    except BaseException:
        router.shutdown()
        raise
    return router, [str(url)]
