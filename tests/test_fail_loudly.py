"""Broken runs do not exit 0: non-finite numbers and steps that train nothing are skipped,
counted, and end the run after ``train.max_bad_steps`` in a row, naming the cause."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loongsage_core.controller.health import StepHealth, TrainingFailedError, diagnose
from loongsage_hookspecs import Trajectory, TrajectoryGroup, TrajectoryStatus


def group(*statuses: TrajectoryStatus, error: str | None = None) -> TrajectoryGroup:
    g = TrajectoryGroup(group_id="0:0", prompt_id="p", source="s")
    for i, status in enumerate(statuses):
        t = Trajectory(id=f"t{i}", prompt_id="p", group_id="0:0", source="s", prompt="q")
        t.status = status
        t.error = error if status == TrajectoryStatus.FAILED else None
        g.trajectories.append(t)
    return g


def test_diagnose_names_each_kind_of_bad_step():
    ok = {"rollout/num_rows": 8.0, "train/loss": 0.1, "train/grad_norm": 1.0, "train/num_mini_batches": 1.0}
    assert diagnose(ok, [group(TrajectoryStatus.COMPLETED)]) is None
    assert diagnose({**ok, "train/loss": float("nan")}, []) == "train/loss is nan"
    assert diagnose({**ok, "train/grad_norm": float("inf")}, []) == "train/grad_norm is inf"
    assert "skipped" in diagnose({**ok, "train/skipped_step": 1.0}, [])
    failed = group(TrajectoryStatus.FAILED, TrajectoryStatus.FAILED, error="reward 'r' raised KeyError: 'x'")
    assert diagnose({"rollout/num_rows": 0.0}, [failed]) == (
        "trained zero rows: 2 of 2 trajectories failed, 2 with: reward 'r' raised KeyError: 'x'")
    # every group dropped by the filters: nothing to learn from, not a fault
    assert diagnose({"rollout/num_rows": 0.0, "rollout/failed_ratio": 0.0}, []) is None
    assert "every trajectory failed" in diagnose({"rollout/num_rows": 0.0, "rollout/failed_ratio": 1.0}, [])


def test_bad_steps_in_a_row_end_the_run_and_a_good_one_resets_the_count():
    health = StepHealth(max_bad_steps=2)
    bad = {"train/loss": float("nan")}
    good = {"rollout/num_rows": 4.0, "train/loss": 0.5}
    assert health.observe(0, bad, [])["fault/bad_step"] == 1.0 and health.last_problem == "train/loss is nan"
    assert health.observe(1, good, [])["fault/bad_step"] == 0.0 and health.last_problem is None
    assert health.observe(2, bad, [])["fault/bad_steps"] == 2.0
    with pytest.raises(TrainingFailedError, match=r"2 bad steps in a row \(train.max_bad_steps = 2\); step 3: "
                                                  r"train/loss is nan"):
        health.observe(3, bad, [])
    with pytest.raises(TrainingFailedError, match="weights became non-finite"):
        StepHealth(5).observe(0, {"train/nonfinite_weights": 3.0}, [])


USER_MODULE = '''
from loongsage_hookspecs import hookimpl, AdvantageSpec, AdvantageOutput, RewardSpec


def broken_judge(trajectory, **kwargs):
    raise ValueError("the judge service is offline")


def nan_advantage(inputs, **kwargs):
    return AdvantageOutput(advantages=inputs.response_mask.float() * float("nan"))


@hookimpl
def loongsage_rewards():
    yield RewardSpec(name="broken_judge", fn=broken_judge, description="raises on every call")


@hookimpl
def loongsage_advantages():
    yield AdvantageSpec(name="nan_advantage", fn=nan_advantage, description="NaN advantages")
'''


def write_job(tiny_job, tmp_path: Path) -> Path:
    (tmp_path / "faulty.py").write_text(USER_MODULE)
    return tiny_job.write(tmp_path)


def test_reward_raising_on_every_call_exits_non_zero_naming_the_exception(tiny_job, tmp_path):
    job = write_job(tiny_job, tmp_path)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir", str(out),
                           "data.0.reward=broken_judge", 'plugins.modules=["faulty.py"]', "train.max_bad_steps=2",
                           "train.total_steps=5"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loongsage: error: 2 bad steps in a row (train.max_bad_steps = 2); step 1: trained zero "
                           "rows: 8 of 8 trajectories failed"), last
    assert "reward 'broken_judge' raised ValueError: the judge service is offline" in last
    assert "Traceback" not in proc.stderr
    # the first bad step was logged with its fault metrics, and no weight version was spent on it
    (first,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert first["fault/bad_step"] == 1.0 and first["perf/weight_version"] == 0.0


def test_nan_loss_is_skipped_then_ends_the_run(ray_cluster, tiny_job, tmp_path):
    write_job(tiny_job, tmp_path)
    out = tmp_path / "run"
    with pytest.raises(TrainingFailedError, match=r"3 bad steps in a row .*step 2: train/loss is nan"):
        tiny_job.run(tmp_path, out, "algorithm.advantage=nan_advantage", 'plugins.modules=["faulty.py"]')
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["fault/bad_steps"] for m in metrics] == [1.0, 2.0]
    assert all(m["perf/weight_version"] == 0.0 for m in metrics)  # skipped: nothing reached the engines


def test_bad_steps_in_async_mode_are_skipped_then_end_the_run(ray_cluster, tiny_job, tmp_path):
    """The asynchronous loop counts a skipped step like the synchronous one (its scheduler accepts
    the step's end although no weights were pushed) and ends the run after max_bad_steps."""
    write_job(tiny_job, tmp_path)
    out = tmp_path / "run"
    with pytest.raises(TrainingFailedError, match=r"3 bad steps in a row .*step 2: train/loss is nan"):
        tiny_job.run(tmp_path, out, "algorithm.advantage=nan_advantage", 'plugins.modules=["faulty.py"]',
                     "async.enable=true", "placement.colocate=false", "rollout.weight_transport=shm",
                     'plugins.enable=["torch", "rl", "rewards", "loggers", "agents", "schedulers"]')
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["fault/bad_steps"] for m in metrics] == [1.0, 2.0]
    assert all(m["fault/bad_step"] == 1.0 for m in metrics)


def test_a_step_whose_update_overflows_is_rolled_back_and_later_steps_train(ray_cluster, tiny_job, tmp_path):
    import ray

    from loongsage_core.config import load_job
    from loongsage_core.controller.run import SyncLoop
    from loongsage_core.controller.runtime import Run
    from loongsage_core.resolve import resolve_job

    def trainer_state(actor):  # runs in the trainer actor: its parameters and AdamW state
        worker = actor.worker
        params = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        state = [{k: v.clone() for k, v in worker.optimizer.state[p].items()}
                 for p in worker.model.parameters() if p in worker.optimizer.state]
        return params, state

    def spike_lr(actor):  # a finite lr whose AdamW update overflows float32, for the next step only
        actor.worker.optimizer.param_groups[0]["lr"] = 1e39

    out = tmp_path / "run"
    job = load_job(tiny_job.write(tmp_path), ["train.total_steps=4", "run.checkpoint_every=0"])
    run = Run(resolve_job(job), out)
    seen = {}
    original = run.learner.train

    def train(batch, step):
        trainer = run.actors.trainers[0]
        if step == 1:
            seen["before"] = ray.get(trainer.__ray_call__.remote(trainer_state))
            ray.get(trainer.__ray_call__.remote(spike_lr))
        metrics = original(batch, step)
        if step == 1:
            seen["after"] = ray.get(trainer.__ray_call__.remote(trainer_state))
        return metrics

    run.learner.train = train
    try:
        run.start()
        history = SyncLoop(run).fit()
    finally:
        run.close()
    assert [m["step"] for m in history] == [0, 1, 2, 3]
    assert [m["fault/bad_step"] for m in history] == [0.0, 1.0, 0.0, 0.0]
    assert [m["train/rolled_back_step"] for m in history] == [0.0, 1.0, 0.0, 0.0]
    assert history[1]["train/lr"] == 1e39 and history[1]["train/nonfinite_weights"] > 0
    # the step was taken back: parameters and optimizer state bit for bit as after step 0
    (params_before, state_before), (params_after, state_after) = seen["before"], seen["after"]
    assert params_before.keys() == params_after.keys() and len(state_before) == len(state_after) > 0
    for name, value in params_before.items():
        assert torch.equal(value.view(torch.int32), params_after[name].view(torch.int32)), name
    for before, after in zip(state_before, state_after):
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
    # nothing was pushed for it; later steps trained and the engine serves finite weights equal to
    # the trainer's (the rollout log-probs match the trainer's at every later step)
    assert [m["perf/weight_version"] for m in history] == [1.0, 1.0, 2.0, 3.0]
    assert all(m["train/is_approx_k3_kl"] < 1e-6 for m in history)
    entries = [json.loads(line) for line in (out / "trained_prompts.jsonl").read_text().splitlines()]
    assert ["skipped" in e for e in entries] == [False, True, False, False]
    assert entries[1]["skipped"].startswith("train/rolled_back_step: the optimizer step overflowed the weights")


def test_an_lr_that_always_overflows_exits_non_zero_naming_the_metric(tiny_job, tmp_path):
    job = tiny_job.write(tmp_path)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir", str(out),
                           "train.lr=1e39", "train.max_bad_steps=2", "train.total_steps=5"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loongsage: error: 2 bad steps in a row (train.max_bad_steps = 2); step 1: "
                           "train/rolled_back_step: the optimizer step overflowed the weights "
                           "(train/nonfinite_weights = "), last
    assert "train/lr = 1e+39) and was rolled back" in last and "Traceback" not in proc.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["fault/bad_step"] for m in metrics] == [1.0]
    assert all(m["perf/weight_version"] == 0.0 for m in metrics)  # no overflowed weights reached the engines
