"""Checks of a job beyond its schema, run by ``loongsage validate`` and before ``loongsage run``
starts anything: sizes that must fit together, per-source sampling settings the engines accept,
model directories that can be loaded, data files that decode, an output directory that can be
written. Each problem is a :class:`~loongsage_core.config.ConfigError` naming the file and key.

Nothing here imports torch, ray or transformers: model directories are checked by reading their
``config.json`` and listing their weight files.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

from .config import SEED_MAX, ConfigError, JobConfig

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.pt", "*.pth")
"""Files of which a model directory needs at least one (Hugging Face and torch formats)."""


def _where(job: JobConfig) -> str:
    return job.source_path or "<job>"


def check_sizes(job: JobConfig) -> None:
    """Batch sizes and actor counts that must fit together."""
    where, train, rollout = _where(job), job.train, job.rollout
    if train.micro_batch_size > train.mini_batch_size:
        raise ConfigError(f"{where}: train.micro_batch_size ({train.micro_batch_size}) must not exceed "
                          f"train.mini_batch_size ({train.mini_batch_size}): a micro-batch is a slice of a mini-batch")
    if rollout.max_new_tokens >= rollout.max_context_length:
        raise ConfigError(f"{where}: rollout.max_new_tokens ({rollout.max_new_tokens}) must be less than "
                          f"rollout.max_context_length ({rollout.max_context_length}), which also holds the prompt")
    if job.placement.colocate and rollout.num_engines > train.num_workers:
        raise ConfigError(f"{where}: placement.colocate = true needs rollout.num_engines "
                          f"({rollout.num_engines}) <= train.num_workers ({train.num_workers})")


def _number(lo: float, hi: float, *, lo_open: bool = False, integer: bool = False,
            extra: tuple[float, ...] = ()) -> Callable[[Any], str | None]:
    """A check returning what is wrong with a value (``None`` when it is fine)."""
    kind = "an integer" if integer else "a finite number"
    span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    also = f" or {', '.join(repr(e) for e in extra)}" if extra else ""

    def check(value: Any) -> str | None:
        if value in extra and not isinstance(value, bool):
            return None
        ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
        return None if ok else f"must be {kind} in {span}{also}, got {value!r}"

    return check


SAMPLING_CHECKS: Mapping[str, Callable[[Any], str | None]] = {
    "temperature": _number(0.0, math.inf),
    "top_p": _number(0.0, 1.0, lo_open=True),
    "top_k": _number(1, 2**31 - 1, integer=True, extra=(-1,)),
    "min_p": _number(0.0, 1.0),
    "max_new_tokens": _number(1, 2**31 - 1, integer=True),
    "seed": _number(0, SEED_MAX, integer=True),
    "sampling_seed": _number(0, SEED_MAX, integer=True),
    "repetition_penalty": _number(0.0, math.inf, lo_open=True),
    "presence_penalty": _number(-2.0, 2.0),
    "frequency_penalty": _number(-2.0, 2.0),
}
"""Ranges of the sampling settings that SGLang and the embedded engine reject outside them."""


def check_sampling(job: JobConfig) -> None:
    """Each source's ``sampling`` table: the values engines would reject only once Ray is up."""
    where = _where(job)
    for i, src in enumerate(job.data):
        for key, value in src.sampling.items():
            check = SAMPLING_CHECKS.get(key)
            problem = check(value) if check else None
            if problem:
                raise ConfigError(f"{where}: data[{i}].sampling.{key}: {problem}")
        new_tokens = src.sampling.get("max_new_tokens", job.rollout.max_new_tokens)
        if isinstance(new_tokens, int) and new_tokens >= job.rollout.max_context_length:
            raise ConfigError(f"{where}: data[{i}].sampling.max_new_tokens ({new_tokens}) must be less than "
                              f"rollout.max_context_length ({job.rollout.max_context_length})")


def check_model_dir(path: Path, key: str, where: str) -> None:
    """A Hugging Face model directory: a readable ``config.json`` (an object with ``model_type``)
    and at least one weight file."""
    if not path.exists():
        raise ConfigError(f"{where}: {key}: '{path}' does not exist")
    if not path.is_dir():
        raise ConfigError(f"{where}: {key}: '{path}' is not a directory (a Hugging Face model directory)")
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(f"{where}: {key}: no config.json in model directory '{path}'")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: {key}: '{config}' is not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: {key}: '{config}' is not valid JSON: {exc.msg} "
                          f"(line {exc.lineno}, column {exc.colno})") from None
    except OSError as exc:
        raise ConfigError(f"{where}: {key}: cannot read '{config}': {exc.strerror or exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{where}: {key}: '{config}' must be a JSON object with a 'model_type' string")
    if not any(next(path.glob(pattern), None) is not None for pattern in WEIGHT_PATTERNS):
        raise ConfigError(f"{where}: {key}: model directory '{path}' has no weight files "
                          f"(looked for {', '.join(WEIGHT_PATTERNS)})")


def check_models(job: JobConfig) -> None:
    """The policy's, the teachers' and the critic's model directories, where the job names one
    (a path that is set is not blank)."""
    where = _where(job)
    for key, value in (("model.path", job.model.path), ("critic.path", job.critic.path),
                       *((f"teachers[{i}].path", t.path) for i, t in enumerate(job.teachers))):
        if value is not None and not value.strip():
            raise ConfigError(f"{where}: {key} is empty: give a model directory, or remove the key")
    if job.model.path:
        check_model_dir(Path(job.resolve_path(job.model.path)), "model.path", where)
    for i, teacher in enumerate(job.teachers):
        if teacher.path:
            check_model_dir(Path(job.resolve_path(teacher.path)), f"teachers[{i}].path", where)
    if job.critic.path:
        check_model_dir(Path(job.resolve_path(job.critic.path)), "critic.path", where)


def check_data_files(job: JobConfig) -> None:
    """Every data file reads as the run will read it, row by row (nothing is kept): it exists and
    is not empty; JSONL lines are UTF-8 JSON objects within ``max_line_bytes``; parquet files and
    saved datasets load; in an RL job every row has its prompt, a non-blank string or chat messages
    of valid Unicode (a supervised job's conversations are checked as it loads them). Errors name
    the file and line (or row). Procedural sources are built at run."""
    from .data_sources import iter_rows, read_source

    for i, src in enumerate(job.data):
        if src.path:
            for _ in (read_source(job, i, None) if job.sft is not None else iter_rows(job, i, None)):
                pass


def check_lora(job: JobConfig) -> None:
    """``[train] lora`` settings that cannot work with the rest of the job."""
    where, lora = _where(job), job.train.lora
    if lora is None:
        return
    if job.algorithm.ref_update_every:
        raise ConfigError(f"{where}: algorithm.ref_update_every = {job.algorithm.ref_update_every} with "
                          "train.lora: the KL reference of a LoRA run is its base model (the adapter disabled), "
                          "which never changes; drop ref_update_every")


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Keys of a Hugging Face config that give a mixture-of-experts model's experts per layer."""


def check_router_replay(job: JobConfig) -> None:
    """``[algorithm] router_replay`` needs a policy with mixture-of-experts layers: an inline
    ``[model] config`` or the model directory's ``config.json`` naming its experts."""
    if not job.algorithm.router_replay:
        return
    where = _where(job)
    if job.model.config:
        config, source = dict(job.model.config), "[model] config"
    elif job.model.path:
        path = Path(job.resolve_path(job.model.path)) / "config.json"
        config, source = json.loads(path.read_text(encoding="utf-8")), str(path)
    else:
        return
    experts = [config.get(key) for key in EXPERT_COUNT_KEYS]
    if not any(isinstance(n, int) and not isinstance(n, bool) and n > 1 for n in experts):
        raise ConfigError(f"{where}: algorithm.router_replay = true, but the policy ({source}, model_type "
                          f"{config.get('model_type')!r}) has no mixture-of-experts layers (none of "
                          f"{', '.join(EXPERT_COUNT_KEYS)}): there is no routing to replay")


def check_job(job: JobConfig) -> None:
    """Every check of this module, in the order a user would fix them."""
    check_sizes(job)
    check_lora(job)
    check_sampling(job)
    check_models(job)
    check_router_replay(job)
    check_data_files(job)


def check_output_dir(path: Path, key: str = "--output-dir") -> None:
    """Create ``path`` if needed and prove it writable (before any actor starts)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"{key}: cannot write to run directory '{path}': {reason}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot write to run directory '{path}'")
