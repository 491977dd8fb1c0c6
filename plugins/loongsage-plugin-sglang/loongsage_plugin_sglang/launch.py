"""The ``python -m sglang.launch_server`` command line of one rollout engine, built from a job.

Flags that come from the job (SGLang's own argument names):

* ``--model-path``: ``[model] path`` resolved against the job file (SGLang loads a Hugging Face
  directory; an inline ``[model] config`` cannot be served);
* ``--tokenizer-path``: ``[model] tokenizer`` when set (its directory when it names a file);
* ``--host`` / ``--port``: the engine context's host and a free port;
* ``--dtype``: ``[model] dtype``; ``--context-length``: ``[rollout] max_context_length``;
* ``--random-seed``: ``[run] seed`` plus the engine index (engines sample differently);
* ``--tp-size``: 1 unless ``engine_args`` says otherwise; ``--weight-version``: ``0``;
* ``--enable-memory-saver`` in colocated runs with ``[placement] offload`` (the engine releases
  its memory while the trainer trains, which SGLang only allows with the memory saver);
* with ``[train] lora``: ``--enable-lora``, ``--max-lora-rank`` (the rank) and
  ``--lora-target-modules`` (the module names; ``all`` for ``"all-linear"``), so the trained
  adapter can be loaded by name (``/load_lora_adapter``); in a colocated run with offload also
  ``--enable-weights-cpu-backup``: only the adapter is sent after training, so the base weights
  must come back from host memory when the engine takes its memory back;
* with ``[model] fp32_lm_head``: ``--enable-fp32-lm-head``, so the engine's logits come from a
  float32 output projection as the trainer's do (the same train-inference consistency option as
  the embedded engine's);
* with ``[algorithm] router_replay``: ``--enable-return-routed-experts``, so a mixture-of-experts
  engine can answer ``return_routed_experts`` (the experts each token was routed to, which the
  trainer replays).

Every key of ``[rollout] engine_args`` becomes ``--kebab-case`` (``mem_fraction_static = 0.7`` ->
``--mem-fraction-static 0.7``): ``true`` is a bare flag, ``false`` leaves it out, a list repeats
its values after one flag (``--cuda-graph-bs 1 2 4``), a table is passed as JSON. Keys unknown to
LoongSage are passed through unchanged (SGLang's parser is the judge); keys that would contradict
the job (``model_path``, ``host``, ``port``, ``dtype``, ``context_length``, ...) are refused with
the job key to set instead.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from loongsage_hookspecs import JobSettings

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
"""``[model] dtype`` -> SGLang ``--dtype`` value."""

RESERVED: dict[str, str] = {
    "model_path": "[model] path",
    "host": "the engine context (engines bind loopback)",
    "port": "the engine context (a free port is chosen)",
    "dtype": "[model] dtype",
    "context_length": "[rollout] max_context_length",
    "tokenizer_path": "[model] tokenizer",
    "api_key": "the run secret (every run generates one)",
    "admin_api_key": "the run secret (every run generates one)",
}
"""``engine_args`` keys LoongSage sets from the job, and where each one is configured instead."""

_KEY_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


class LaunchConfigError(ValueError):
    """The job cannot be turned into an SGLang command line; the message names the key at fault."""


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _scalar(key: str, value: Any, where: str, expected: str = "a string or a number") -> str:
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return str(value)
    raise LaunchConfigError(f"{where}: [rollout] engine_args.{key} holds a {type(value).__name__} ({value!r}); "
                            f"expected {expected}")


def engine_args_to_flags(engine_args: Mapping[str, Any], where: str = "<job>") -> list[str]:
    """``[rollout] engine_args`` as SGLang command-line flags (see the module docstring)."""
    argv: list[str] = []
    for key, value in engine_args.items():
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise LaunchConfigError(f"{where}: [rollout] engine_args has an invalid key {key!r}; "
                                    "keys are SGLang argument names like mem_fraction_static")
        norm = key.replace("-", "_")
        if norm in RESERVED:
            raise LaunchConfigError(f"{where}: [rollout] engine_args.{key} is set by LoongSage from "
                                    f"{RESERVED[norm]}; set it there instead")
        flag = _flag(norm)
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            if not value:
                raise LaunchConfigError(f"{where}: [rollout] engine_args.{key} is an empty list; "
                                        "remove the key or give at least one value")
            items = []
            for i, item in enumerate(value):
                if isinstance(item, bool) or isinstance(item, (list, tuple, dict)):
                    raise LaunchConfigError(f"{where}: [rollout] engine_args.{key}[{i}] is {item!r}; list "
                                            "entries must be strings or numbers")
                items.append(_scalar(f"{key}[{i}]", item, where))
            argv += [flag, *items]
        elif isinstance(value, Mapping):
            argv += [flag, json.dumps(dict(value), sort_keys=True)]
        else:
            argv += [flag, _scalar(key, value, where, "a string, number, boolean, list or table")]
    return argv


def tokenizer_dir(job: JobSettings) -> str | None:
    """``[model] tokenizer`` as a directory SGLang can load (a file's parent directory)."""
    if not job.model.tokenizer:
        return None
    path = Path(job.resolve_path(job.model.tokenizer))
    return str(path.parent if path.is_file() else path)


def _require_flag(args: dict[str, Any], key: str, where: str, needed_by: str, instead: str) -> None:
    """Turn on the SGLang flag ``key`` (snake or kebab case in ``args``) that the job needs;
    an explicit other value is a :class:`LaunchConfigError` saying what needs it and what to set
    ``instead``."""
    value = args.pop(key, args.pop(key.replace("_", "-"), True))
    if value is not True:
        raise LaunchConfigError(f"{where}: [rollout] engine_args.{key} = {value!r}, but {needed_by}; remove the key "
                                f"or set {instead}")
    args[key] = True


def build_launch_command(job: JobSettings, *, host: str = "127.0.0.1", port: int, engine_index: int = 0,
                         python: str | None = None, engine_args: Mapping[str, Any] | None = None) -> list[str]:
    """The full ``python -m sglang.launch_server ...`` argv for engine ``engine_index`` of ``job``.

    ``engine_args`` replaces ``job.rollout.engine_args`` when given (the launcher passes the table
    without its own keys).
    """
    where = job.source_path or "<job>"
    if not job.model.path:
        raise LaunchConfigError(f"{where}: the sglang rollout engine needs [model] path (a Hugging Face model "
                                "directory); an inline [model] config can only be served by the torch engine")
    if job.model.dtype not in DTYPES:
        raise LaunchConfigError(f"{where}: [model] dtype {job.model.dtype!r} has no SGLang equivalent")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise LaunchConfigError(f"{where}: invalid engine port {port!r}")
    args = dict(job.rollout.engine_args if engine_args is None else engine_args)
    tp_size = args.pop("tp_size", args.pop("tp-size", 1))
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise LaunchConfigError(f"{where}: [rollout] engine_args.tp_size must be a positive integer, got {tp_size!r}")
    seed = args.pop("random_seed", args.pop("random-seed", int(job.run.seed) + int(engine_index)))
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise LaunchConfigError(f"{where}: [rollout] engine_args.random_seed must be an integer, got {seed!r}")
    version = args.pop("weight_version", args.pop("weight-version", "0"))
    placement = getattr(job, "placement", None)
    if placement is not None and placement.colocate and placement.offload:
        _require_flag(args, "enable_memory_saver", where, "a colocated run with [placement] offload = true releases "
                      "the engine's memory while training, which needs it", "placement.offload = false")
    lora = getattr(getattr(job, "train", None), "lora", None)
    if lora is not None:
        targets = list(lora.target_modules)
        args.setdefault("enable_lora", True)
        args.setdefault("max_lora_rank", int(lora.rank))
        args.setdefault("lora_target_modules", ["all"] if targets == ["all-linear"] else targets)
        if "enable_memory_saver" in args:
            args.setdefault("enable_weights_cpu_backup", True)
    if getattr(job.model, "fp32_lm_head", False):
        _require_flag(args, "enable_fp32_lm_head", where, "[model] fp32_lm_head = true computes the trainer's logits "
                      "in float32", "model.fp32_lm_head = false")
    # constrained turns (forced tool calls, structured output): the router sends Lark grammars in
    # llguidance's syntax and the trainer replays llguidance's masks, so SGLang decodes with it too
    args.setdefault("grammar_backend", "llguidance")
    if job.algorithm.router_replay:
        _require_flag(args, "enable_return_routed_experts", where, "[algorithm] router_replay = true replays the "
                      "experts the engine returns", "algorithm.router_replay = false")
    argv = [python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", job.resolve_path(job.model.path)]
    tok = tokenizer_dir(job)
    if tok:
        argv += ["--tokenizer-path", tok]
    argv += ["--host", host, "--port", str(port),
             "--dtype", DTYPES[job.model.dtype],
             "--context-length", str(int(job.rollout.max_context_length)),
             "--random-seed", str(seed),
             "--tp-size", str(tp_size),
             "--weight-version", _scalar("weight_version", version, where)]
    return argv + engine_args_to_flags(args, where)
