"""Held-out evaluation end to end (real Ray, engines and trainer): a run killed with ``kill -9`` and
resumed logs the same training and evaluation metrics as an uninterrupted one, and ``loongsage
eval`` on a checkpoint gives the numbers the run's own evaluation gave at that step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EVAL = ('eval={data=[{name="held", generator="arithmetic", generator_args={num_samples=6, seed=21}}], '
        'every=1, samples=2}')
COMPARED = ("rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm",
            "eval/held/pass@1", "eval/held/pass@2", "eval/held/reward_mean", "eval/held/response_length_mean")


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_kill_9_and_resume_with_eval_and_loongsage_eval_on_a_checkpoint(ray_cluster, tiny_job, tmp_path):
    from loongsage_core.config import load_job
    from loongsage_core.controller.eval_job import evaluate_job
    from loongsage_core.resolve import resolve_job

    job = tiny_job.write(tmp_path)
    straight = tmp_path / "straight"
    tiny_job.run(tmp_path, straight, EVAL)
    a = read_metrics(straight)
    assert [m["step"] for m in a] == [0, 1, 2, 3] and all("eval/held/pass@1" in m for m in a)

    # the same job in a process killed hard once step 1's checkpoint is complete, then resumed
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir", str(killed), EVAL]
    log = tmp_path / "killed.log"
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 300
    try:
        while not (killed / "checkpoints" / "step_000002" / "manifest.json").exists():
            assert proc.poll() is None, f"the run ended before it could be killed: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint of step 2 appeared"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    tiny_job.run(tmp_path, killed, EVAL, "run.resume=true")
    b = read_metrics(killed)
    assert [m["step"] for m in b] == [0, 1, 2, 3]  # the redone steps replaced, the final evaluation once
    for ma, mb in zip(a, b):
        for key in COMPARED:
            if key in ma:
                assert mb[key] == ma[key], (ma["step"], key)

    # loongsage eval on the checkpoint of step 2: the run's evaluation before step 2
    result = evaluate_job(resolve_job(load_job(job, [EVAL])), checkpoint=str(straight / "checkpoints" / "step_000002"))
    assert result["step"] == 2
    for key, value in result["metrics"].items():
        assert value == a[2][key], key
    assert subprocess.run([sys.executable, "-m", "loongsage_core", "eval", str(job), "--checkpoint", "step_9"],
                          capture_output=True, text=True).returncode == 2  # a wrong target is one line, exit 2


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "latest", "--run-dir", "{tmp}/nowhere"], "--checkpoint latest: no intact checkpoint in"),
    (["--checkpoint", "{tmp}"], "is neither a checkpoint"),
])
def test_loongsage_eval_refuses_what_it_cannot_evaluate(tiny_job, tmp_path, argv, message):
    job = tiny_job.write(tmp_path)
    args = [a.format(tmp=tmp_path) for a in argv]
    done = subprocess.run([sys.executable, "-m", "loongsage_core", "eval", str(job), *args, EVAL],
                          capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    plain = subprocess.run([sys.executable, "-m", "loongsage_core", "eval", str(job)], capture_output=True, text=True)
    assert plain.returncode == 2 and "the job has no [[eval.data]] source" in plain.stderr
