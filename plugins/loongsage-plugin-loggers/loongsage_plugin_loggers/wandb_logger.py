"""The ``wandb`` logger: per-step metrics, the run's config and a final summary in Weights & Biases.

Offline by default (``mode = "offline"``): it needs no network and no account, and writes a run
directory under ``<output_dir>/wandb/`` that ``wandb sync <output_dir>/wandb/offline-run-*`` uploads
later. ``mode = "online"`` logs live (``WANDB_API_KEY`` or ``wandb login`` first).

The run id is kept in ``<output_dir>/wandb_run_id``, so a resumed LoongSage run continues the same
W&B run (``resume = "allow"``). W&B history cannot be rewritten: steps that a resume redoes are
logged again against the ``step`` axis (every metric is plotted over ``step``, declared with
``define_metric``), so the newest value of a redone step is the one a resumed run trained.

With ``completions = N`` (default 8) it also logs, each step, a ``rollout/completions`` table of
N trajectories drawn from the step's rollout records (step, source, agent, status, reward and its
reason, prompt, response, length, staleness), like the completion tables of other RL trainers.

``wandb`` is imported when the first step is logged.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import random
import secrets
import string
import struct
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, NamedTuple

if TYPE_CHECKING:  # pragma: no cover - typing only
    from loongsage_hookspecs import LoggerContext

RUN_ID_FILE = "wandb_run_id"
STEP_AXIS = "step"
COMPLETIONS_KEY = "rollout/completions"
COMPLETION_COLUMNS = ["step", "source", "agent", "status", "reward", "reason", "prompt", "response",
                      "response_length", "staleness"]


def new_run_id() -> str:
    """A fresh W&B run id: 8 characters of lowercase letters and digits, as W&B makes them."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _load_config(output_dir: Path) -> dict[str, Any]:
    """The resolved job (``config.resolved.toml``) as a dict, when the run wrote one."""
    path = output_dir / "config.resolved.toml"
    if not path.is_file():
        return {}
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    with path.open("rb") as f:
        return tomllib.load(f)


class WandbLogger:
    """Logs each step's numeric metrics to a W&B run over the ``step`` axis.

    Args:
        ctx: the logger's context (``ctx.output_dir``: the run's output directory; W&B's files go
            to ``<output_dir>/wandb``).
        project: the W&B project.
        name: the run's display name (default: the output directory's name).
        mode: ``"offline"`` (default: no network), ``"online"`` or ``"disabled"``.
        entity, group, tags, notes: passed to ``wandb.init``.
        completions: trajectories per step in the ``rollout/completions`` table (0: no table).
    """

    def __init__(self, ctx: "LoggerContext", *, project: str = "loongsage",
                 name: str | None = None, mode: str = "offline", entity: str | None = None,
                 group: str | None = None, tags: list[str] | tuple[str, ...] = (),
                 notes: str | None = None, completions: int = 8) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb logger: mode must be 'offline', 'online' or 'disabled', not {mode!r}")
        if isinstance(completions, bool) or not isinstance(completions, int) or completions < 0:
            raise ValueError(f"wandb logger: completions must be a non-negative integer, not {completions!r}")
        self.output_dir = Path(ctx.output_dir)
        self.project = project
        self.name = name or self.output_dir.resolve().name
        self.mode = mode
        self.entity = entity
        self.group = group
        self.tags = list(tags)
        self.notes = notes
        self.completions = completions
        self._lock = threading.Lock()  # trajectories arrive from the records writer's thread
        self._run: Any = None
        self._closed = False
        self._last: dict[str, float | int] = {}

    @property
    def run_id(self) -> str | None:
        """The W&B run id of this LoongSage run (kept across resumes), once the run started."""
        path = self.output_dir / RUN_ID_FILE
        return path.read_text(encoding="utf-8").strip() if path.is_file() else None

    def _start(self) -> Any:
        try:
            import wandb
        except ImportError:
            raise ImportError("wandb logger needs the wandb package: "
                              "pip install 'loongsage-plugin-loggers[wandb]'") from None

        self.output_dir.mkdir(parents=True, exist_ok=True)
        run_id = self.run_id
        if run_id is None:
            run_id = new_run_id()
            (self.output_dir / RUN_ID_FILE).write_text(run_id + "\n", encoding="utf-8")
        run = wandb.init(project=self.project, name=self.name, id=run_id, resume="allow", mode=self.mode,
                         dir=str(self.output_dir), entity=self.entity, group=self.group, tags=self.tags,
                         notes=self.notes, config=_load_config(self.output_dir),
                         settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        run.define_metric(STEP_AXIS)
        run.define_metric("*", step_metric=STEP_AXIS)
        return run

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._closed:
            raise RuntimeError(f"wandb logger: log() after close() ({self.output_dir})")
        with self._lock:
            self._log(step, metrics)

    def _log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._run is None:
            self._run = self._start()
        row: dict[str, float | int] = {}
        for key, value in metrics.items():
            if hasattr(value, "item"):
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            if math.isfinite(float(value)):
                row[str(key)] = float(value)
        row[STEP_AXIS] = int(step)
        self._run.log(row)
        self._last.update(row)

    @property
    def wants_trajectories(self) -> bool:
        """Whether the host should hand this logger rollout records (for the completions table)."""
        return self.completions > 0

    def log_trajectories(self, step: int, records: list[Mapping[str, Any]]) -> None:
        """Log ``rollout/completions``: a table of ``completions`` of the step's records (seeded by the step)."""
        if self._closed or not self.completions or not records:
            return
        chosen = sorted(random.Random(int(step)).sample(range(len(records)), min(self.completions, len(records))))
        rows = [completion_row(records[i]) for i in chosen]
        with self._lock:
            if self._run is None:
                self._run = self._start()
            import wandb

            self._run.log({COMPLETIONS_KEY: wandb.Table(columns=COMPLETION_COLUMNS, data=rows), STEP_AXIS: int(step)})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._run is not None:
            import wandb

            self._run.summary.update(self._last)
            self._run.finish()
            self._run = None
            # finish() returns before W&B's service has written the offline files; stopping the
            # service flushes them, so the run directory is complete when close() returns
            wandb.teardown()


def completion_row(record: Mapping[str, Any]) -> list[Any]:
    """One rollout record (docs/reference/records.md) as a row of the completions table."""
    reward = record.get("reward") or {}
    prompt = record.get("prompt")
    if isinstance(prompt, list):  # chat messages: the last user message
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else json.dumps(prompt)
    response = record.get("response_text") or ""
    if not response and record.get("turns"):
        response = record["turns"][-1].get("response_text") or ""
    return [record.get("step"), record.get("source"), record.get("agent"), record.get("status"),
            reward.get("score"), reward.get("reason") or reward.get("error") or record.get("error") or "",
            "" if prompt is None else str(prompt), response, record.get("response_length"), record.get("staleness")]


def _records(path: Path) -> Iterator[Any]:
    """The protobuf records of one ``.wandb`` transaction log (LevelDB log format, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log")
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (2, 3):  # first / middle piece of a record that spans blocks
            pending += payload
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending + payload)
        pending = b""
        yield record


class OfflineRun(NamedTuple):
    """What the offline W&B files of one LoongSage run hold."""

    run_ids: set[str]
    config: dict[str, Any]
    history: list[dict[str, Any]]


def read_offline_history(output_dir: str | os.PathLike[str]) -> OfflineRun:
    """Read a run's offline W&B files without network: run ids, config, history rows in order.

    Reads every ``<output_dir>/wandb/offline-run-*/run-*.wandb`` (a resumed run adds one directory
    per resume, all with the same run id). Useful to check a run before ``wandb sync``.
    """
    out = OfflineRun(set(), {}, [])
    for path in sorted(Path(output_dir).glob("wandb/offline-run-*/run-*.wandb")):
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out.run_ids.add(record.run.run_id)
                for item in record.run.config.update:
                    out.config[item.key] = json.loads(item.value_json)
            elif kind == "config":
                for item in record.config.update:
                    out.config[item.key] = json.loads(item.value_json)
            elif kind == "history":
                out.history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                    for i in record.history.item})
    return out
