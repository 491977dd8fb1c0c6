"""Rollout records survive ``kill -9`` and a resume: aligned with metrics.jsonl, nothing twice or lost.

An asynchronous run (the records hook of the async loop) keeps 5 records per step
(``run.rollout_records = 5``) and prints a sampled trajectory every 2 steps on the console.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loongsage_core import read_rollouts, rollout_steps

REPO = Path(__file__).resolve().parents[2]

JOB = f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents", "schedulers"]
[model]
path = "{REPO / 'configs' / 'quickstart' / 'model'}"
[train]
lr = 2e-4
total_steps = 6
mini_batch_size = 32
micro_batch_size = 16
[rollout]
prompts_per_step = 4
samples_per_prompt = 4
max_new_tokens = 8
weight_transport = "shm"
partial = true
[placement]
colocate = false
[async]
enable = true
scheduler = "windowed_fifo"
stale_steps = 1
[run]
checkpoint_every = 1
keep_checkpoints = 10
rollout_records = 5
[[data]]
name = "add"
generator = "arithmetic"
generator_args = {{ num_samples = 24, digits = 1, num_operands = 2, ops = "+-" }}
[[loggers]]
name = "jsonl"
[[loggers]]
name = "console"
args = {{ live = false, show_samples = 2 }}
"""


def test_sigkill_and_resume_keep_records_aligned_with_metrics(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd + ["train.total_steps=1000"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = out / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:  # kill hard once a few checkpoints exist
            if latest.exists() and latest.read_text() >= "step_000003":
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.2)
        else:
            pytest.fail("no checkpoint appeared")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resume_step = int(latest.read_text().split("_")[1])
    kept = {s: (out / "rollouts" / f"step_{s:06d}.jsonl.gz").read_bytes() for s in range(resume_step)}
    assert set(rollout_steps(out)) >= set(range(resume_step))  # flushed before each checkpoint completed

    started = time.time()
    done = subprocess.run(cmd + ["run.resume=true"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [json.loads(x)["prompt_ids"] for x in (out / "trained_prompts.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == rollout_steps(out) == list(range(6))
    seen: set[str] = set()
    for step in range(6):
        path = out / "rollouts" / f"step_{step:06d}.jsonl.gz"
        if step < resume_step:  # before the checkpoint: left as they were
            assert path.read_bytes() == kept[step]
        else:  # redone by the resumed run
            assert path.stat().st_mtime >= started
        records = read_rollouts(out, step)
        assert len(records) == 5 and {r["step_total"] for r in records} == {16}
        assert {r["prompt_id"] for r in records} <= set(trained[step])
        ids = {r["id"] + "@" + r["prompt_id"] for r in records}
        assert not ids & seen
        seen |= ids
        for r in records:
            assert r["staleness"] is not None and 0 <= r["staleness"] <= 1
    assert not list((out / "rollouts").glob("*.tmp"))
    # the console showed a sampled trajectory every 2 steps of the resumed run
    samples = [ln for ln in done.stdout.splitlines() if ln.startswith("── sample of step")]
    assert [int(s.split()[4].rstrip(":")) for s in samples] == [s for s in range(resume_step, 6) if (s + 1) % 2 == 0]
