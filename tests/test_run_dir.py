"""Run directories and checkpoints that cannot lose data.

Unit tests of the manifest (written last, verified on resume, pruning) and end-to-end runs on the
embedded backends: a truncated ``controller.json``, a broken trainer file, a rerun without
``run.resume`` and ``--overwrite`` all keep every step of history.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from loongsage_core.config import ConfigError
from loongsage_core.run_files import checkpoint as ckpt
from loongsage_core.run_files.run_dir import prepare_run_dir

# --------------------------------------------------------------------------------------------
# Manifest, verification, pruning (no Ray)
# --------------------------------------------------------------------------------------------


def fake_checkpoint(out: Path, step: int, keep: int = 0) -> Path:
    d = ckpt.prepare_step_dir(out, step)
    (d / "trainer").mkdir()
    (d / "trainer" / "trainer_state.pt").write_bytes(bytes(range(256)) * (step + 1))
    (d / "trainer" / "rng_rank0.pt").write_bytes(b"rng" * step)
    ckpt.write_controller_state(out, step, {"step": step, "version": step, "data": {}}, keep=keep)
    return d


def test_manifest_lists_every_file_and_is_written_last(tmp_path):
    d = fake_checkpoint(tmp_path, 2)
    manifest = json.loads((d / ckpt.MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {"controller.json", "trainer/trainer_state.pt", "trainer/rng_rank0.pt"}
    assert manifest["files"]["trainer/trainer_state.pt"]["size"] == 256 * 3
    assert ckpt.verify(d) is None
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"


@pytest.mark.parametrize("damage, reason", [
    (lambda d: (d / "controller.json").write_text('{"step": 2, "ver'), "has 16 bytes, the manifest says"),
    (lambda d: (d / "trainer" / "rng_rank0.pt").write_bytes(b""), "rng_rank0.pt' has 0 bytes"),
    (lambda d: (d / "trainer" / "trainer_state.pt").unlink(), "trainer_state.pt' is missing"),
    (lambda d: (d / ckpt.MANIFEST_FILE).unlink(), "no manifest.json (the save did not finish)"),
    (lambda d: (d / "trainer" / "trainer_state.pt").write_bytes(bytes(reversed(range(256))) * 3),
     "trainer_state.pt' does not match its SHA-256"),
])
def test_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, damage, reason):
    fake_checkpoint(tmp_path, 1)
    newest = fake_checkpoint(tmp_path, 2)
    damage(newest)
    point, skipped = ckpt.find_resumable(tmp_path)
    assert point is not None and point.step == 1
    assert [d for d, _ in skipped] == [newest]
    assert reason in skipped[0][1]


def test_pruning_keeps_the_newest_intact_checkpoints_only(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step, keep=2)
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [3, 2]
    # a broken newer checkpoint never pushes the intact ones out, nor is it counted
    broken = ckpt.prepare_step_dir(tmp_path, 4)
    (broken / "controller.json").write_text("{")
    fake_checkpoint(tmp_path, 5, keep=1)
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [5, 4]
    assert ckpt.find_resumable(tmp_path)[0].step == 5


def test_rerun_into_a_run_directory_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="already holds a run .*metrics.jsonl.*run.resume=true.*--overwrite"):
        prepare_run_dir(out, resume=False, overwrite=False, where="job.toml")
    with pytest.raises(ConfigError, match="has no intact checkpoint"):
        prepare_run_dir(out, resume=True, overwrite=False, where="job.toml")
    with pytest.raises(ConfigError, match="contradict"):
        prepare_run_dir(out, resume=True, overwrite=True, where="job.toml")
    prepare_run_dir(out, resume=False, overwrite=True, where="job.toml")
    assert list(out.iterdir()) == []
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(moved) == 1 and (moved[0] / "metrics.jsonl").read_text() == '{"step": 0}\n'


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------

def steps_of(out: Path, name: str) -> list[int]:
    return [json.loads(line)["step"] for line in (out / name).read_text().splitlines()]


def test_truncated_controller_json_resumes_from_the_previous_checkpoint(ray_cluster, tiny_job, tmp_path, caplog):
    out = tmp_path / "run"
    tiny_job.run(tmp_path, out)
    prompts_before = (out / "trained_prompts.jsonl").read_text().splitlines()
    newest = ckpt.step_dir(out, 3) / ckpt.CONTROLLER_FILE
    newest.write_text(newest.read_text()[:10])  # a save cut short by a full disk
    with caplog.at_level(logging.WARNING, logger="loongsage"):
        history = tiny_job.run(tmp_path, out, "run.resume=true", "train.total_steps=4")
    assert [m["step"] for m in history] == [2, 3]  # resumed at step 2, not from scratch
    assert any("CHECKPOINT SKIPPED" in r.message and "step_000003" in r.message and "resuming from step_000002"
               in r.message for r in caplog.records)
    # no step of history lost, none doubled
    assert steps_of(out, "metrics.jsonl") == [0, 1, 2, 3]
    assert steps_of(out, "trained_prompts.jsonl") == [0, 1, 2, 3]
    assert (out / "trained_prompts.jsonl").read_text().splitlines()[:2] == prompts_before[:2]
    assert ckpt.verify(ckpt.step_dir(out, 3)) is None  # rewritten whole
    assert ckpt.latest_checkpoint(out)[0] == 4


def test_rerun_without_resume_loses_nothing_and_overwrite_moves_aside(ray_cluster, tiny_job, tmp_path):
    out = tmp_path / "run"
    tiny_job.run(tmp_path, out, "train.total_steps=2")
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        tiny_job.run(tmp_path, out, "train.total_steps=3")
    assert (out / "metrics.jsonl").read_text() == before
    tiny_job.run(tmp_path, out, "train.total_steps=3", "run.resume=true")
    assert steps_of(out, "metrics.jsonl") == [0, 1, 2]
    tiny_job.run(tmp_path, out, "train.total_steps=1", overwrite=True)
    assert steps_of(out, "metrics.jsonl") == [0]
    (old,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert steps_of(old, "metrics.jsonl") == [0, 1, 2]


def test_broken_trainer_file_under_a_valid_manifest_names_the_file(ray_cluster, tiny_job, tmp_path):
    out = tmp_path / "run"
    tiny_job.run(tmp_path, out, "train.total_steps=1")
    d = ckpt.step_dir(out, 1)
    rng = d / "trainer" / "rng_rank0.pt"
    rng.write_bytes(b"")
    ckpt.write_manifest(d)  # the manifest agrees with the broken file: only loading can tell
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint file '{rng}' cannot be read"):
        tiny_job.run(tmp_path, out, "train.total_steps=2", "run.resume=true")
