"""Asynchronous training with three sources, three agents and uneven lengths, killed and resumed.

Sources weighted 0.5 / 0.3 / 0.2, five groups per step (exact shares 2.5 / 1.5 / 1): a single-turn
source sampled at temperature 30 (near-uniform over the vocabulary, so it seldom hits an end-of-turn
token: samples of up to 200 tokens, about half as long on average), the ``tool_agent`` with a Python tool in
the ``local`` sandbox, and a black-box program through the ``command`` agent (two model calls of 8
tokens), all generating at once through the real router and engine on a local Ray cluster. The run
is killed with SIGKILL once three checkpoints exist and resumed with ``run.resume=true``; over the
whole epoch (6 steps, 30 prompts) every step trains each source's quota (floor or ceil of its
share, the very schedule of :class:`StepQuotas`, across the kill too), no trained group is staler
than ``stale_steps``, every prompt is trained exactly once, and with partial rollout some
trajectories hold tokens of two weight versions.
"""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loongsage_core.controller.mixing import StepQuotas

REPO = Path(__file__).resolve().parent.parent
SOURCES = {"long": 0.5, "tools": 0.3, "blackbox": 0.2}
PER_STEP = 5
STEPS = 6
SIZES = {name: round(w * PER_STEP * STEPS) for name, w in SOURCES.items()}  # one epoch: 15 / 9 / 6

TOOLS = '''
def add(a: int = 1, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
'''

JOB = """
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents", "schedulers"]
[model]
path = "{model}"
[train]
lr = 2e-4
total_steps = {steps}
mini_batch_size = 32
micro_batch_size = 16
[rollout]
prompts_per_step = {per_step}
samples_per_prompt = 2
max_new_tokens = 8
weight_transport = "shm"
partial = true
[placement]
colocate = false
[agentflow]
agent_timeout_s = 120
[async]
enable = true
scheduler = "windowed_fifo"
stale_steps = 1
[run]
checkpoint_every = 1
keep_checkpoints = 10

[[data]]
name = "long"
weight = 0.5
generator = "arithmetic"
generator_args = {{ num_samples = {long}, digits = 1, num_operands = 2, ops = "+-" }}
agent = "single_turn"
sampling = {{ max_new_tokens = 200, temperature = 30.0 }}   # near-uniform: long, uneven samples

[[data]]
name = "tools"
weight = 0.3
generator = "arithmetic"
generator_args = {{ num_samples = {tools}, digits = 1, num_operands = 2, ops = "+" }}
agent = "tool_agent"
sandbox = "local"
agent_args = {{ tools = ["{tools_file}:add"], max_turns = 2 }}
sampling = {{ temperature = 0.7 }}

[[data]]
name = "blackbox"
weight = 0.2
generator = "arithmetic"
generator_args = {{ num_samples = {blackbox}, digits = 1, num_operands = 2, ops = "-" }}
agent = "command"
agent_args = {{ command = ["{python}", "{blackbox_agent}", "--turns", "2", "--max-tokens", "8"] }}
reward = ["numeric_match"]

[[loggers]]
name = "jsonl"
"""


def write_job(root: Path) -> Path:
    tools = root / "tools.py"
    tools.write_text(TOOLS)
    job = root / "job.toml"
    job.write_text(JOB.format(model=REPO / "configs" / "quickstart" / "model", steps=STEPS, per_step=PER_STEP,
                              tools_file=tools, python=sys.executable,
                              blackbox_agent=REPO / "examples" / "blackbox_agent.py", **SIZES))
    return job


def test_three_sources_keep_their_shares_and_the_bound_through_kill_and_resume(tmp_path):
    job = write_job(tmp_path)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(cmd + ["train.total_steps=1000"], env=env, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)
    latest = out / "checkpoints" / "latest"
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline:  # kill hard in the middle of the epoch
            if latest.exists() and latest.read_text() >= "step_000003":
                break
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.2)
        else:
            pytest.fail("no checkpoint appeared")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    state = json.loads((out / "checkpoints" / latest.read_text().strip() / "controller.json").read_text())
    assert state["scheduler"]["name"] == "windowed_fifo" and state["scheduler"]["version"] >= 3

    done = subprocess.run(cmd + ["run.resume=true"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    lines = [json.loads(x) for x in (out / "trained_prompts.jsonl").read_text().splitlines()]
    assert len(lines) == STEPS
    quotas = StepQuotas(list(SOURCES.values()), PER_STEP)
    for step, line in enumerate(lines):
        counts = collections.Counter(p.split("/")[0] for p in line["prompt_ids"])
        for name, weight in SOURCES.items():  # floor or ceil of the share, the same schedule throughout
            share = PER_STEP * weight
            assert math.floor(share) <= counts[name] <= math.ceil(share), (step, counts)
        assert [counts[n] for n in SOURCES] == quotas(step), (step, counts)
    trained = collections.Counter(p for line in lines for p in line["prompt_ids"])
    assert sorted(trained) == sorted(f"{n}/{i}" for n, size in SIZES.items() for i in range(size))
    assert set(trained.values()) == {1}  # each prompt of the epoch exactly once despite the kill

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert m["rollout/staleness_max"] <= 1.0
        for name in SOURCES:
            assert m[f"rollout_per_source/{name}/staleness_max"] <= 1.0
            assert m[f"rollout_per_source/{name}/groups"] == quotas(m["step"])[list(SOURCES).index(name)]
        assert m["rollout/failed_ratio"] == 0.0
    assert max(m["rollout/staleness_max"] for m in metrics) == 1.0  # it did run ahead of the trainer
    # long generations outlive weight updates: with partial rollout they continue under new weights
    assert max(m["rollout/partial_ratio"] for m in metrics) > 0
    assert max(m["rollout_per_source/long/partial_ratio"] for m in metrics) > 0
