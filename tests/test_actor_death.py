"""Actor death: a killed engine actor is replaced and the run finishes as planned; a killed
trainer actor ends the run with a message naming it, and the run resumes from its checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loongsage_core.config import load_job
from loongsage_core.controller.faults import ActorDeathError
from loongsage_core.controller.run import make_loop
from loongsage_core.controller.runtime import Run
from loongsage_core.resolve import resolve_job


def kill(actor) -> None:
    """``ray.kill`` and wait until the actor is dead (a kill takes effect asynchronously)."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + 120
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.2)


class KillAt:
    """A logger that kills an actor right after step ``step`` is logged (mid-run, between steps)."""

    def __init__(self, run: Run, step: int, pick) -> None:
        self.run, self.step, self.pick = run, step, pick

    def log(self, step: int, metrics: dict) -> None:
        if step == self.step:
            kill(self.pick(self.run.actors))

    def close(self) -> None:
        pass


def run_with_kill(tiny_job, tmp_path: Path, out: Path, step: int, pick, *overrides: str,
                  kill_while_training: tuple[int, int] | None = None) -> list[dict]:
    """What ``run_job`` does, with the killer logger added; ``kill_while_training = (step, engine)``
    also kills that engine while the trainer trains on that step (its weight push then fails)."""
    job = load_job(tiny_job.write(tmp_path), list(overrides))
    run = Run(resolve_job(job), out)
    loop = make_loop(run)
    if kill_while_training is not None:
        original = run.learner.train

        def train(batch, step):
            out = original(batch, step)
            if step == kill_while_training[0]:
                kill(run.actors.engine_actors[kill_while_training[1]])
            return out

        run.learner.train = train
    try:
        run.start()
        run.loggers.append(KillAt(run, step, pick))
        return loop.fit()
    except Exception as exc:
        raise run.faults.explain(exc) from None
    finally:
        run.close()


def trained(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trained_prompts.jsonl").read_text().splitlines()]


def test_killed_engine_is_replaced_and_the_run_trains_every_step(ray_cluster, tiny_job, tmp_path):
    out = tmp_path / "run"
    history = run_with_kill(tiny_job, tmp_path, out, 1, lambda actors: actors.engine_actors[1],
                            "placement.colocate=false", "rollout.num_engines=2", "rollout.weight_transport=shm",
                            "train.total_steps=4", kill_while_training=(2, 0))
    assert [m["step"] for m in history] == [0, 1, 2, 3]
    # engine 1 killed between steps 1 and 2 (its groups fail and are dispatched again), engine 0 while
    # step 2 trained (the weight push to it fails, it is replaced and the push repeated): one is
    # replaced within step 2 and both by step 3 (on a busy machine the second replacement can land
    # in step 3's count: the failed push is retried there once Ray reports the actor dead)
    restarts = [m["fault/engine_restarts"] for m in history]
    assert restarts[:2] == [0.0, 0.0] and restarts[2] in (1.0, 2.0) and restarts[3] == 2.0, restarts
    # the same number of trained prompts as an undisturbed run: every step trained all of its groups
    per_step = trained(out)
    assert [len(e["prompt_ids"]) for e in per_step] == [2, 2, 2, 2] and not any("skipped" in e for e in per_step)
    assert [m["perf/weight_version"] for m in history] == [1.0, 2.0, 3.0, 4.0]
    # the new engine got the current weights before generating: trainer and engines still agree
    assert all(m["train/is_approx_k3_kl"] < 1e-6 for m in history)


def test_killed_engine_in_an_asynchronous_run_is_replaced(ray_cluster, tiny_job, tmp_path):
    out = tmp_path / "run"
    history = run_with_kill(tiny_job, tmp_path, out, 1, lambda actors: actors.engine_actors[0],
                            "placement.colocate=false", "rollout.num_engines=2", "rollout.weight_transport=shm",
                            'plugins.enable=["torch", "rl", "rewards", "loggers", "agents", "schedulers"]',
                            "async.enable=true", "train.total_steps=4")
    assert [m["step"] for m in history] == [0, 1, 2, 3]
    assert history[-1]["fault/engine_restarts"] == 1.0
    assert [len(e["prompt_ids"]) for e in trained(out)] == [2, 2, 2, 2]
    assert history[-1]["perf/weight_version"] == 4.0


def test_killed_trainer_ends_the_run_naming_it_and_the_run_resumes(ray_cluster, tiny_job, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ActorDeathError) as info:
        run_with_kill(tiny_job, tmp_path, out, 1, lambda actors: actors.trainers[0])
    message = str(info.value)
    assert message.startswith("trainer rank 0 (with engine 0) (Ray actor ")
    assert " on node " in message and "died: it was killed by `ray.kill`" in message
    # killed after step 1 was logged, before its checkpoint (step 2) was saved
    assert message.endswith("resume from checkpoint step 1 with run.resume=true")
    history = tiny_job.run(tmp_path, out, "run.resume=true")
    assert [m["step"] for m in history] == [1, 2]
    assert [e["step"] for e in trained(out)] == [0, 1, 2]
