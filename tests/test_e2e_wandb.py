"""The ``wandb`` logger in a real run: offline W&B files hold every step, and a resume continues them."""

from __future__ import annotations

import json
from pathlib import Path

from loongsage_plugin_loggers.wandb_logger import read_offline_history

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "configs" / "quickstart" / "grpo.toml"
SMALL = ("rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "train.mini_batch_size=8",
         "train.micro_batch_size=8", "run.checkpoint_every=1", 'loggers=[{name="jsonl"},{name="wandb"}]')


def metric_rows(history: list[dict]) -> list[dict]:
    """The history rows that hold a step's metrics (not its completions table)."""
    return [r for r in history if "train/loss" in r]


def test_offline_wandb_run_holds_every_step_and_resume_continues_it(ray_cluster, tmp_path):
    out = tmp_path / "run"
    run_job(resolve_job(load_job(QUICKSTART, [*SMALL, "train.total_steps=2"])), output_dir=str(out))
    run_id = (out / "wandb_run_id").read_text().strip()
    ids, _config, history = read_offline_history(out)
    assert ids == {run_id}
    rows = metric_rows(history)
    assert [r["step"] for r in rows] == [0, 1]
    # each step also logs a completions table from its rollout records (a row of its own); the
    # quickstart's [eval] after the last step logs the table of its evaluation records at step 2
    assert sorted(r["step"] for r in history if "rollout/completions/_type" in r) == [0, 1, 2]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row, m in zip(rows, metrics):
        assert row["rollout/reward_mean"] == m["rollout/reward_mean"]
        assert row["train/loss"] == m["train/loss"]

    run_job(resolve_job(load_job(QUICKSTART, [*SMALL, "train.total_steps=3", "run.resume=true"])),
            output_dir=str(out))
    ids, _config, history = read_offline_history(out)
    assert ids == {run_id}  # the same W&B run, continued
    assert [r["step"] for r in metric_rows(history)] == [0, 1, 2]
    assert len(list(out.glob("wandb/offline-run-*"))) == 2  # `wandb sync` uploads both into one run
