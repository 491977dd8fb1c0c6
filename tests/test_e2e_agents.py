"""Training through AgentFlow: a black-box OpenAI program as the agent, and `loongsage serve`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
from openai import OpenAI

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.controller.serve import start_serving
from loongsage_core.resolve import resolve_job
from loongsage_core.security import read_secret_file

REPO = Path(__file__).resolve().parent.parent

JOB = f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]

[model]
path = "{REPO / 'configs' / 'quickstart' / 'model'}"

[train]
lr = 2e-4
total_steps = 2
mini_batch_size = 16
micro_batch_size = 8

[rollout]
prompts_per_step = 2
samples_per_prompt = 3
max_new_tokens = 8
weight_transport = "inprocess"

[agentflow]
agent_timeout_s = 120

[[data]]
name = "blackbox"
generator = "arithmetic"
generator_args = {{ num_samples = 20, digits = 1, num_operands = 2, ops = "+-" }}
agent = "command"
agent_args = {{ command = ["{sys.executable}", "{REPO / 'examples' / 'blackbox_agent.py'}", "--turns", "2",
                           "--max-tokens", "8"] }}
reward = ["numeric_match"]

[[loggers]]
name = "jsonl"
"""


def test_black_box_agent_trains_through_the_router(ray_cluster, tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    out = tmp_path / "run"
    history = run_job(resolve_job(load_job(path)), output_dir=str(out))
    assert len(history) == 2
    for m in history:
        assert m["rollout/num_trajectories"] == 6.0
        assert m["rollout/failed_ratio"] == 0.0
        # two model turns each, so the recorded rows hold two generated spans per trajectory
        assert m["rollout/num_rows"] >= 6.0
        assert m["train/is_approx_k3_kl"] < 1e-6
        # the second turn extends the first: the engine's prefix cache serves most of its prompt
        assert 0.3 < m["rollout/prefix_cache_hit_ratio"] < 1.0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_serve_exposes_the_policy_to_any_openai_client(ray_cluster, tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    serving = start_serving(resolve_job(load_job(path)), output_dir=tmp_path / "serve")
    try:
        client = OpenAI(base_url=serving.trajectory_url, api_key=serving.trajectory_key)
        reply = client.chat.completions.create(model="policy", max_tokens=6,
                                               messages=[{"role": "user", "content": "What is 2 + 3?"}])
        assert reply.choices[0].finish_reason in ("stop", "length")
        secret = read_secret_file(serving.secret_path)
        record = httpx.get(f"{serving.router.base_url}/admin/trajectories/{serving.trajectory_id}",
                           headers={"Authorization": f"Bearer {secret}"}).json()
        (segment,) = record["segments"]
        generated = sum(segment["loss_mask"])
        assert generated == reply.usage.completion_tokens
    finally:
        serving.close()
