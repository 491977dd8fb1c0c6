"""Finding and loading verifiers environments, and turning their tasks into LoongSage rows.

verifiers 0.4 ships only its v1 stack (``verifiers.v1``): an environment is a **taskset** (the
data: typed tasks whose ``@vf.reward`` / ``@vf.metric`` methods score a finished trace), an
``Env`` (how one task becomes one episode: which seats play it, how they interact, ``finalize``
judging the episode's traces) and per seat a **harness** (the program that talks to the model).
``vf.load_environment(config)`` builds one from its config, the ``[env]`` table of a verifiers run:
``taskset.id`` names the taskset package (an installed package, or any module on the path,
exporting its ``Taskset`` subclass in ``__all__``), the rest are the taskset's, the env's and the
seats' settings.

Here an environment is named by ``env`` (the taskset id) and ``env_args`` (the rest of that
``[env]`` table, e.g. ``{taskset = {num_tasks = 50}, agent = {max_turns = 4}}``). Two defaults
differ from a verifiers eval, both because a training run happens on this machine: a seat whose
``runtime`` is not set runs its harness as a local subprocess (verifiers' default is a remote
Prime sandbox, which needs an account and the network), and loading fails with a ``ValueError``
naming the environment and the cause (a missing package, an unknown key, a broken module).
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any, Mapping

ROW_KEY = "verifiers"
"""The key of a row's metadata that carries what the environment's rollout needs."""

SPLITS = ("train", "eval")


def env_key(env: str, env_args: Mapping[str, Any]) -> str:
    """A stable identity of an environment's configuration (for caches and row checks)."""
    return json.dumps({"env": env, "env_args": env_args}, sort_keys=True, default=str)


def _env_error(env: str, exc: BaseException) -> ValueError:
    detail = " ".join(str(exc).split())
    if len(detail) > 600:
        detail = detail[:600] + " ..."
    return ValueError(f"verifiers environment {env!r} cannot be loaded: {type(exc).__name__}: {detail}")


def env_config_dict(env: str, env_args: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[env]`` table verifiers resolves: ``env_args`` with ``taskset.id = env`` and every
    seat that sets no ``runtime`` running in a local subprocess."""
    import verifiers.v1 as vf

    if not isinstance(env, str) or not env.strip():
        raise ValueError(f"env must name a verifiers environment (its taskset package), got {env!r}")
    raw: dict[str, Any] = copy.deepcopy(dict(env_args))
    taskset = raw.get("taskset", {})
    if not isinstance(taskset, Mapping):
        raise ValueError(f"verifiers environment {env!r}: env_args.taskset must be a table, got {taskset!r}")
    if "id" in taskset and taskset["id"] != env:
        raise ValueError(f"verifiers environment {env!r}: env_args.taskset.id = {taskset['id']!r} differs from "
                         "env; name the taskset once, in env")
    raw["taskset"] = {**taskset, "id": env}
    try:
        cls = vf.env_config_type(env, str(raw.get("id") or ""))
    except Exception as exc:  # a missing or broken package: verifiers' own import error says which
        raise _env_error(env, exc) from None
    for name, field in cls.model_fields.items():
        if isinstance(field.default, vf.AgentConfig):
            seat = raw.get(name)
            if seat is None:
                raw[name] = {"runtime": {"type": "subprocess"}}
            elif isinstance(seat, Mapping) and "runtime" not in seat:
                raw[name] = {**seat, "runtime": {"type": "subprocess"}}
    return raw


@functools.lru_cache(maxsize=32)
def _load(env: str, args_json: str) -> Any:
    import verifiers.v1 as vf

    raw = env_config_dict(env, json.loads(args_json))
    try:
        return vf.load_environment(vf.resolve_env_config(raw))
    except Exception as exc:
        raise _env_error(env, exc) from None


def load_env(env: str, env_args: Mapping[str, Any] | None = None) -> Any:
    """The ``verifiers.v1.Env`` for ``env`` / ``env_args`` (built once per process and
    configuration); a ``ValueError`` naming the environment when it cannot be built."""
    args = dict(env_args or {})
    try:
        args_json = json.dumps(args, sort_keys=True)
    except TypeError as exc:
        raise ValueError(f"verifiers environment {env!r}: env_args must be plain TOML values: {exc}") from None
    return _load(env, args_json)


def split_args(env: str, env_args: Mapping[str, Any], split: str) -> dict[str, Any]:
    """``env_args`` for one split of the taskset.

    verifiers tasksets have no train/eval datasets of their own; a taskset that holds both declares
    a ``split`` setting in its config, which ``split`` sets. A taskset without one has only its
    training tasks: asking it for ``"eval"`` is an error that says how to hold tasks out instead
    (``select``, verifiers' own task selection, over a range of ``idx``)."""
    import verifiers.v1 as vf

    if split not in SPLITS:
        raise ValueError(f"verifiers environment {env!r}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    try:
        config_cls = vf.taskset_config_type(env)
    except Exception as exc:
        raise _env_error(env, exc) from None
    args = copy.deepcopy(dict(env_args))
    taskset = dict(args.get("taskset") or {})
    if "split" in config_cls.model_fields:
        if "split" in taskset and taskset["split"] != split:
            raise ValueError(f"verifiers environment {env!r}: env_args.taskset.split = {taskset['split']!r} "
                             f"contradicts split = {split!r}; set it once, with split")
        taskset["split"] = split
        args["taskset"] = taskset
    elif split == "eval":
        raise ValueError(f"verifiers environment {env!r}: its taskset ({config_cls.__name__}) has no 'split' "
                         "setting, so it has no held-out tasks; use split = 'train' with select "
                         "(e.g. select = {include = {idx = ['0:50']}}) to choose the tasks of each source")
    return args


def task_rows(env: str, env_args: Mapping[str, Any], *, split: str = "train",
              select: Mapping[str, Any] | None = None, num_samples: int | None = None) -> list[dict[str, Any]]:
    """The taskset's tasks (of ``split``, through verifiers' ``select``) as LoongSage rows.

    A row's ``prompt`` is the task's conversation as chat messages (its ``system_prompt`` first),
    its ``label`` the task's ``answer`` field when it has one, and ``metadata["verifiers"]`` what
    the environment's rollout needs to rebuild the very task: the environment (``env``,
    ``env_args``), the task's wire data (``task``: its ``TaskData`` as JSON, with every
    task-specific field, its ``info``), its index in the taskset (``idx``) and its key."""
    import verifiers.v1 as vf

    args = split_args(env, env_args, split)
    environment = load_env(env, args)
    try:
        tasks: Any = environment.taskset
        if select:
            tasks = tasks.select(vf.SelectConfig.model_validate(dict(select)))
        if not tasks.bounded and num_samples is None:
            raise ValueError("its taskset is infinite; set num_samples (or select a closed idx range)")
        if num_samples is not None:
            tasks = tasks.take(num_samples)
        rows = [task_row(env, args, task) for task in tasks]
    except ValueError as exc:
        raise ValueError(f"verifiers environment {env!r}: {exc}") from None
    except Exception as exc:  # the taskset's own load() failing
        raise _env_error(env, exc) from None
    if not rows:
        raise ValueError(f"verifiers environment {env!r} (split {split!r}) has no tasks"
                         + (" for this select" if select else ""))
    return rows


def task_row(env: str, env_args: Mapping[str, Any], task: Any) -> dict[str, Any]:
    """One task as a row (see :func:`task_rows`)."""
    data = task.data
    wire = data.model_dump(mode="json", exclude_defaults=True)
    answer = getattr(data, "answer", None)
    return {"prompt": prompt_messages_of(data), "label": answer if answer is None else str(answer),
            "metadata": {ROW_KEY: {"env": env, "env_args": dict(env_args), "task": wire, "idx": data.idx,
                                   "key": task.key}}}


def prompt_messages_of(data: Any) -> list[dict[str, Any]]:
    """A task's opening conversation as OpenAI chat messages (its system prompt first)."""
    from verifiers.v1.dialects.chat import message_to_wire

    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages.extend(message_to_wire(m) for m in data.prompt)
    if not messages:
        raise ValueError(f"task {data.idx} has no prompt (a task the user opens needs an env that "
                         "opens it; LoongSage rows need a prompt to show)")
    return messages


def rebuild_task(environment: Any, wire: Mapping[str, Any]) -> Any:
    """The task a row carries, rebuilt as verifiers' env server rebuilds a dispatched task: its
    data validated into the taskset's ``TaskData`` type, in its ``Task`` type, with the
    environment's task config."""
    task_cls = type(environment.taskset).task_type()
    data = task_cls.data_type().model_validate(dict(wire))
    return task_cls(data, environment.config.taskset.task)


def check_env(env: str, env_args: Mapping[str, Any] | None = None) -> None:
    """Raise ``ValueError`` naming the environment when it cannot be loaded (``loongsage validate``)."""
    load_env(env, env_args)
