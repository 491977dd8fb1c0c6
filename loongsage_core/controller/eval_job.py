"""``loongsage eval``: the job's ``[eval]`` on any checkpoint or Hugging Face directory.

The evaluation is the run's own (:class:`.evaluation.Evaluator` through a :class:`.runtime.Run`'s
engines, router and rewards), so on a checkpoint of step N it samples what the run's evaluation
before step N sampled and gives the same numbers. What it evaluates (``--checkpoint``):

* nothing given: the job's ``[model]`` as it is (step 0);
* ``latest``: the newest intact checkpoint of the run directory (its step);
* ``final``: the run directory's ``final_hf/`` (step ``train.total_steps``);
* a directory: a checkpoint (``checkpoints/step_N``, with its ``controller.json``) or a Hugging Face
  model directory (``config.json``; step 0 unless ``--step``).

It writes nothing into the run directory: the run secret and the resolved job of the evaluation
go to a temporary directory, removed afterwards.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs

from ..config import ConfigError, JobConfig
from ..resolve import ResolvedJob
from ..run_files import checkpoint as ckpt
from .runtime import Run

STEP_DIR = re.compile(r"^step_(\d+)$")


@attrs.define(frozen=True)
class Target:
    """What an evaluation loads: a checkpoint (``point``) or a model directory (``model_dir``), and
    the step it stands for (the evaluation's sampling seeds follow it)."""

    step: int
    point: ckpt.ResumePoint | None = None
    model_dir: Path | None = None

    def describe(self) -> str:
        if self.point is not None:
            return str(self.point.directory)
        return str(self.model_dir) if self.model_dir is not None else "the job's [model]"


def find_target(job: JobConfig, checkpoint: str | None, run_dir: Path, step: int | None) -> Target:
    """The :class:`Target` that ``--checkpoint`` names (see the module docstring)."""
    if checkpoint is None:
        return Target(step=step or 0)
    if checkpoint == "latest":
        point, skipped = ckpt.find_resumable(run_dir)
        ckpt.warn_skipped(skipped, point.directory if point else None)
        if point is None:
            raise ConfigError(f"--checkpoint latest: no intact checkpoint in '{run_dir / 'checkpoints'}'")
        return Target(step=point.step, point=point)
    if checkpoint == "final":
        return model_target(run_dir / "final_hf", job.train.total_steps if step is None else step, "--checkpoint final")
    path = Path(checkpoint).expanduser()
    match = STEP_DIR.match(path.name)
    if match and (path / ckpt.CONTROLLER_FILE).is_file():
        point, reason = ckpt.read_point(path, int(match.group(1)))
        if point is None:
            raise ConfigError(f"--checkpoint: '{path}' cannot be used: {reason}")
        return Target(step=point.step, point=point)
    return model_target(path, step or 0, "--checkpoint")


def model_target(path: Path, step: int, key: str) -> Target:
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: '{path}' is neither a checkpoint (checkpoints/step_N with "
                          f"{ckpt.CONTROLLER_FILE}) nor a Hugging Face model directory (no config.json)")
    return Target(step=step, model_dir=path)


def evaluate_job(resolved: ResolvedJob, *, checkpoint: str | None = None, run_dir: str | None = None,
                 step: int | None = None) -> dict[str, Any]:
    """Evaluate the job's ``[eval]`` on what ``checkpoint`` names; ``{"step", "evaluated",
    "metrics"}`` (``run_dir``: where ``latest`` and ``final`` are looked for; default the job's
    ``run.output_dir``)."""
    job = resolved.job
    where = job.source_path or "<job>"
    if not job.eval.enabled:
        raise ConfigError(f"{where}: eval.data: the job has no [[eval.data]] source to evaluate")
    runs = Path(run_dir).expanduser() if run_dir else Path(job.resolve_path(job.run.output_dir))
    target = find_target(job, checkpoint, runs, step)
    if target.model_dir is not None:  # the directory's weights and tokenizer instead of the job's model
        model = attrs.evolve(job.model, path=str(target.model_dir.resolve()), config={}, tokenizer=None)
        resolved = attrs.evolve(resolved, job=attrs.evolve(job, model=model))
    scratch = Path(tempfile.mkdtemp(prefix="loongsage-eval-"))
    run = Run(resolved, scratch)
    try:
        run.start_actors()
        if target.point is not None:
            run.load_checkpoint(target.point)
        assert run.phases is not None
        run.phases.to_generation()
        metrics = run.evaluate(target.step)
    finally:
        run.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return {"step": target.step, "evaluated": target.describe(), "metrics": metrics}


def format_table(result: dict[str, Any]) -> str:
    """The evaluation as a table: one row per source, one column per metric."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in result["metrics"].items():
        _, source, metric = key.split("/", 2)
        rows.setdefault(source, {})[metric] = value
    columns = sorted({m for r in rows.values() for m in r}, key=lambda m: (not m.startswith("pass@"), m))
    header = ["source", *columns]
    lines = [[source, *(f"{r[c]:.4g}" if c in r else "-" for c in columns)] for source, r in sorted(rows.items())]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    text = [f"evaluated {result['evaluated']} (step {result['step']})"]
    text += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [header, *lines]]
    return "\n".join(text)


def write_result(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
