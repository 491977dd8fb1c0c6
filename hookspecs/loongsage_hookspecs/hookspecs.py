"""The hook functions of the LoongSage contract.

Each hook is a *provider*: a plugin implements it (with ``@hookimpl``) and returns an iterable of
typed specs. The host calls every hook once per process, collects the specs, normalises their
names, rejects a name provided twice, and selects components by the names a job file gives.
Pipelines whose order matters (filters, corrections, router middleware, loggers) are composed in
the order of the job file, never in plugin registration order.

A hookspec's body is never called (pluggy calls the plugins' implementations); each returns an
empty tuple, what a plugin that provides nothing of that kind would return.

The :data:`~.kinds.KINDS` table (:mod:`.kinds`) maps each component kind (the word a job file and
``loongsage plugins`` use) to its hook and spec class; it stays importable from here too.
"""

from __future__ import annotations

from typing import Iterable

from .kinds import KINDS as KINDS
from .kinds import Kind as Kind
from .markers import hookspec
from .specs import (
    AdvantageSpec,
    AgentSpec,
    AggregationSpec,
    CorrectionSpec,
    DataSourceSpec,
    EngineRouterSpec,
    FilterSpec,
    KLSpec,
    LoggerSpec,
    PolicyLossSpec,
    RewardSpec,
    RolloutEngineSpec,
    RouterMiddlewareSpec,
    SandboxSpec,
    SchedulerSpec,
    TeacherManagerSpec,
    TeacherSpec,
    TrainBackendSpec,
    WeightTransportSpec,
)


@hookspec
def loongsage_agents() -> Iterable[AgentSpec]:
    """Provide agents: programs that run one trajectory against an OpenAI-compatible endpoint.

    The host passes nothing. Return :class:`AgentSpec` objects whose ``factory(ctx: BuildContext,
    **args)`` builds an object with ``async run(ctx: AgentContext) -> AgentResult``; ``args`` come
    from the data source's ``agent_args`` table in the job file.

    Example::

        @hookimpl
        def loongsage_agents():
            yield AgentSpec(name="echo", description="answers once", factory=EchoAgent)
    """
    return ()


@hookspec
def loongsage_rewards() -> Iterable[RewardSpec]:
    """Provide reward functions that score a finished trajectory.

    The host calls ``fn(trajectory: Trajectory, **args)`` (``args`` from ``reward_args``) after
    the agent returns, in a worker thread with a time limit; it must return a float or a
    :class:`Reward`, whose score and ``details`` are finite numbers with ``|x| <= 1e6``. An
    exception, a timeout or any other value (``nan``, ``None``, ``'yes'``) marks the trajectory
    failed with the error recorded; the run goes on. A spec with ``needs_sandbox=True`` is called
    ``fn(trajectory, sandbox=sandbox, **args)`` before the trajectory's sandbox is destroyed and
    runs commands in it with the synchronous ``sandbox.run(command, timeout_s=...)``.
    A :class:`Reward` may say why in ``reason`` (kept in the rollout records, shown by
    ``loongsage view``).

    Example::

        @hookimpl
        def loongsage_rewards():
            yield RewardSpec(name="length", fn=lambda traj: len(traj.response_text) / 100)
    """
    return ()


@hookspec
def loongsage_data_sources() -> Iterable[DataSourceSpec]:
    """Provide procedural data sources (synthetic task generators).

    The host calls ``factory(ctx: BuildContext, **args)`` (``args`` from the data source's
    ``generator_args``) and expects an iterable of rows
    ``{"prompt": ..., "label": ..., "metadata": {...}}``, deterministic for the same arguments.

    Example::

        @hookimpl
        def loongsage_data_sources():
            yield DataSourceSpec(name="addition", factory=make_addition_rows)
    """
    return ()


@hookspec
def loongsage_sandboxes() -> Iterable[SandboxSpec]:
    """Provide sandbox providers for agents that execute code or commands.

    ``factory(ctx: BuildContext, **args)`` returns a ``SandboxProvider``; for each trajectory the
    host calls
    ``create(trajectory_id, row)`` (the data row: the provider prepares the sandbox from the
    :class:`SandboxRequest` that ``sandbox_request(row)`` reads in it), runs the agent, runs the
    rewards (those with ``needs_sandbox`` get the sandbox), then calls ``destroy``, also when the
    agent raises or times out; at the end of the run it calls the provider's ``close()``.

    Example::

        @hookimpl
        def loongsage_sandboxes():
            yield SandboxSpec(name="local", factory=LocalSandboxProvider)
    """
    return ()


@hookspec
def loongsage_advantages() -> Iterable[AdvantageSpec]:
    """Provide advantage estimators.

    The host calls ``fn(inputs: AdvantageInputs, **args)`` on the rows of one step (``args`` from
    ``[algorithm] advantage_args``) and expects an :class:`AdvantageOutput` with per-token
    advantages ``[B, T]``. ``token_rewards`` hold the penalties folded into the reward (KL,
    distillation), never the score; ``sample_index`` groups the rows (segments) of one trajectory,
    which group statistics must count once.

    Example::

        @hookimpl
        def loongsage_advantages():
            yield AdvantageSpec(name="grpo", fn=grpo_advantage, description="group-normalised")
    """
    return ()


@hookspec
def loongsage_policy_losses() -> Iterable[PolicyLossSpec]:
    """Provide policy losses.

    The host calls ``fn(inputs: PolicyLossInputs, **args)`` per micro-batch and expects a
    :class:`PolicyLossOutput` with a per-token loss ``[B, T]``; the host applies masks and weights
    and aggregates globally.

    Example::

        @hookimpl
        def loongsage_policy_losses():
            yield PolicyLossSpec(name="reinforce", fn=lambda x: PolicyLossOutput(-x.advantages * x.logprobs))
    """
    return ()


@hookspec
def loongsage_kls() -> Iterable[KLSpec]:
    """Provide KL estimators (to a reference model or, for distillation, to a teacher).

    The host calls ``fn(inputs: KLInputs, **args)`` and expects a per-token KL ``[B, T]``.

    Example::

        @hookimpl
        def loongsage_kls():
            yield KLSpec(name="k1", fn=lambda x: x.logprobs - x.ref_logprobs)
    """
    return ()


@hookspec
def loongsage_loss_aggregations() -> Iterable[AggregationSpec]:
    """Provide loss aggregations (per-token loss -> scalar).

    The host calls ``fn(loss, mask, norm: AggregationNorm, **args)`` on each micro-batch; the sum
    over micro-batches is the mini-batch loss, so ``fn`` divides by ``norm`` only.

    Example::

        @hookimpl
        def loongsage_loss_aggregations():
            yield AggregationSpec(name="token_mean", fn=lambda l, m, n: (l * m).sum() / n.num_tokens)
    """
    return ()


@hookspec
def loongsage_corrections() -> Iterable[CorrectionSpec]:
    """Provide off-policy corrections (importance-sampling weights, token or sequence masks).

    The host calls ``fn(inputs: CorrectionInputs, **args)`` in job-file order and multiplies the
    returned ``weights`` and ``mask`` into the per-token loss.

    Example::

        @hookimpl
        def loongsage_corrections():
            yield CorrectionSpec(name="tis", fn=truncated_is, stage="pre_advantage")
    """
    return ()


@hookspec
def loongsage_router_middlewares() -> Iterable[RouterMiddlewareSpec]:
    """Provide AgentFlow router middleware (request/response inspection and rewriting).

    ``factory(ctx: BuildContext, **args)`` returns an object with ``on_request`` and
    ``on_response``; the router chains them in job-file order. Both see chat-completions bodies
    whatever protocol the agent speaks (the router translates Responses and Anthropic Messages requests). Optional, for
    streaming (the ``StreamingMiddleware`` capability): ``stream_holdback(request, text) -> int``
    declares ``on_response`` safe to run on partial responses and says how many trailing
    characters of the partial text it cannot judge yet (a tool call being written);
    ``changes_response = False`` marks one that never changes responses (a logger; the
    ``ObservingMiddleware`` capability). While a middleware has neither, a turn's text is streamed
    only at its end.

    Example::

        @hookimpl
        def loongsage_router_middlewares():
            yield RouterMiddlewareSpec(name="log_requests", factory=RequestLogger)
    """
    return ()


@hookspec
def loongsage_filters() -> Iterable[FilterSpec]:
    """Provide trajectory-group filters (e.g. drop groups whose rewards have zero spread).

    The host calls ``fn(groups, **args)`` in job-file order after rewards and expects the kept
    groups; dropped groups are counted in ``rollout/filter_drop``.

    Example::

        @hookimpl
        def loongsage_filters():
            yield FilterSpec(name="nonzero_std", fn=lambda gs: [g for g in gs if len(set(g.scores)) > 1])
    """
    return ()


@hookspec
def loongsage_schedulers() -> Iterable[SchedulerSpec]:
    """Provide asynchronous-training schedulers (bounded staleness strategies).

    ``factory(ctx: SchedulerContext, **args)`` returns a ``Scheduler`` (``ctx.batch_size``: the
    groups a step trains, ``ctx.stale_steps``: the staleness bound; ``args``: ``[async]
    scheduler_args``); the host asks it what to dispatch and what the next step may train on. To a
    scheduler that declares ``SourcePicker`` the host also passes ``ctx.quota``
    (``quota(version) -> {source: groups}``, the step's share of each source, floor or ceil of its
    weight) and asks ``next_source(version)`` which source to draw the next prompt from (the
    ``SourcePicker`` capability, declared in the spec; a job with several sources needs it). Optional
    ``state_dict()`` / ``load_state_dict(state)`` (``CheckpointableScheduler``) are saved with
    every checkpoint and loaded on resume, so a resumed run continues the same schedule.

    Example::

        @hookimpl
        def loongsage_schedulers():
            yield SchedulerSpec(name="sync", factory=SyncScheduler)
    """
    return ()


@hookspec
def loongsage_teachers() -> Iterable[TeacherSpec]:
    """Provide teacher backends for on-policy distillation.

    ``factory(ctx: TeacherContext, **args)`` (``ctx.path``: the ``[[teachers]]`` entry's model
    directory; ``args``: its ``args`` table) returns a ``Teacher`` whose ``forward(batch)`` gives
    teacher log-probs over the student's samples. It runs in the run's teacher actor.

    Example::

        @hookimpl
        def loongsage_teachers():
            yield TeacherSpec(name="torch", factory=make_torch_teacher)
    """
    return ()


@hookspec
def loongsage_teacher_managers() -> Iterable[TeacherManagerSpec]:
    """Provide teacher managers: how a step's rows reach the run's teachers.

    The host builds the one ``[placement] teacher_manager`` names (when the job has ``[[teachers]]``),
    in the run's teacher actor, with ``factory(ctx: TeacherManagerContext)``: the run's teachers,
    the data sources' routes and the residency bound; it calls its ``forward`` once per step;
    the manager decides which teacher scores which rows and which teachers stay loaded. It returns
    a ``TeacherRouter``; ``metrics(inputs: KLInputs, *, input_ids)``, when the spec gives one, is
    logged every step over the distilled tokens.

    Example::

        @hookimpl
        def loongsage_teacher_managers():
            yield TeacherManagerSpec(name="per_source", factory=make_teacher_manager, metrics=distill_metrics)
    """
    return ()


@hookspec
def loongsage_weight_transports() -> Iterable[WeightTransportSpec]:
    """Provide weight transports from the trainer to rollout engines.

    ``sender(ctx: WeightTransportContext, **args)`` runs in the trainer (``ctx.role ==
    "sender"``; ``args``: ``[rollout] weight_transport_args``), ``receiver(ctx:
    WeightTransportContext)`` in the engine (``ctx.role == "receiver"``), which finds it by the
    ``load_format`` of the update request. ``receiver = None`` marks a transport whose sender
    speaks formats the engines decode themselves (or other transports' formats).

    Example::

        @hookimpl
        def loongsage_weight_transports():
            yield WeightTransportSpec(name="shm", sender=ShmSender, receiver=ShmReceiver)
    """
    return ()


@hookspec
def loongsage_engine_routers() -> Iterable[EngineRouterSpec]:
    """Provide load balancers to put in front of the rollout engines.

    ``factory(ctx: EngineRouterContext, **args)`` (``ctx.engine_urls``: the engines' URLs,
    ``ctx.api_key``: the run secret they require) runs in the controller and returns an object whose
    ``start()`` returns one URL serving ``/generate`` for all engines and whose ``shutdown()``
    stops it. Generation (the fast path and the AgentFlow router's calls) goes through it; weight
    updates, pause/continue and memory release still go to each engine. A router that declares the
    ``ReplaceableEngines`` capability (``add_engine`` / ``remove_engine``) is told when an engine
    that died is replaced; behind one without it, an engine death ends the run.

    Example::

        @hookimpl
        def loongsage_engine_routers():
            yield EngineRouterSpec(name="sglang_router", factory=SGLangRouterProcess)
    """
    return ()


@hookspec
def loongsage_loggers() -> Iterable[LoggerSpec]:
    """Provide metrics loggers.

    ``factory(ctx: LoggerContext, **args)`` (``ctx.output_dir``: the run directory,
    ``ctx.total_steps``: the planned steps, ``ctx.start_step``: where a resumed run starts)
    returns an object with ``log(step, metrics)`` and ``close()``; every logger in the job file's
    ``[[loggers]]`` list receives every step. Optional
    capabilities, declared in the spec: ``StepTruncation`` (``truncate_after(step)``, called when
    a run resumes at ``step``) and ``TrajectoryLogger`` (``log_trajectories(step, records)`` with
    ``wants_trajectories``: while it is true, each step's rollout records, dicts of the format in
    docs/reference/records.md, arrive from the records writer's thread).

    Example::

        @hookimpl
        def loongsage_loggers():
            yield LoggerSpec(name="jsonl", factory=JsonlLogger)
    """
    return ()


@hookspec
def loongsage_train_backends() -> Iterable[TrainBackendSpec]:
    """Provide train backends.

    ``factory(ctx: TrainWorkerContext)`` (no keyword arguments: ``[train] backend_args`` are in
    ``ctx.job``) runs inside each trainer actor and returns a
    ``TrainWorker`` (forward log-probs, train a mini-batch, export weights, checkpoints).

    Example::

        @hookimpl
        def loongsage_train_backends():
            yield TrainBackendSpec(name="torch", factory=TorchTrainWorker)
    """
    return ()


@hookspec
def loongsage_rollout_engines() -> Iterable[RolloutEngineSpec]:
    """Provide rollout engines.

    ``factory(ctx: EngineContext)`` (no keyword arguments: ``[rollout] engine_args`` are in
    ``ctx.job``) runs inside each engine actor and returns a ``RolloutEngine``
    that serves SGLang's native HTTP API on ``ctx.host`` (its node's address: loopback on one
    machine) and returns a URL with that address. When ``ctx.api_key`` (the run secret) is set,
    every endpoint but the health probes must require ``Authorization: Bearer <api_key>``; without
    it the engine must refuse to listen beyond loopback (``security.check_listen_address``).

    Example::

        @hookimpl
        def loongsage_rollout_engines():
            yield RolloutEngineSpec(name="torch", factory=EmbeddedEngine)
    """
    return ()
