"""Asynchronous training: bounded staleness through real Ray actors (kill -9 and resume of an
asynchronous run: tests/test_async_multisource.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongsage_core.config import ConfigError, load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parent.parent

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
[[data]]
name = "add"
generator = "arithmetic"
generator_args = {{ num_samples = 24, digits = 1, num_operands = 2, ops = "+-" }}
[[loggers]]
name = "jsonl"
"""


def write_job(tmp_path: Path, text: str = JOB) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def trained(out: Path) -> list[list[str]]:
    return [json.loads(x)["prompt_ids"] for x in (out / "trained_prompts.jsonl").read_text().splitlines()]


EVAL = ('eval={data=[{name="held", generator="arithmetic", generator_args={num_samples=4, seed=21}}], '
        'every=2, samples=2}')


@pytest.mark.parametrize("scheduler", ["windowed_fifo", "no_window"])
def test_async_run_bounds_staleness(ray_cluster, tmp_path, scheduler):
    # the windowed_fifo run also evaluates (before steps 0, 2 and 4, and after the last step)
    evaluates = scheduler == "windowed_fifo"
    job = load_job(write_job(tmp_path), [f"async.scheduler={scheduler}", "train.total_steps=5",
                                         *([EVAL] if evaluates else [])])
    out = tmp_path / "run"
    history = run_job(resolve_job(job), output_dir=str(out))
    if evaluates:
        final = history.pop()
        assert final["eval/held/prompts"] == 4.0 and "train/loss" not in final
        assert [i for i, m in enumerate(history) if "eval/held/pass@1" in m] == [0, 2, 4]
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]  # the final evaluation: step 5
    assert len(history) == 5
    for m in history:
        assert m["rollout/staleness_max"] <= 1.0
        for key in ("rollout/staleness_mean", "rollout/partial_ratio", "rollout/pipeline_buf_size",
                    "perf/wait_ratio", "train/loss", "train/is_approx_k3_kl"):
            assert key in m, key
    # after the first step the trainer learns from data one version behind while engines generate
    assert max(m["rollout/staleness_max"] for m in history[1:]) == 1.0
    ids = [p for step in trained(out) for p in step]
    assert len(ids) == len(set(ids)) == 20  # evaluation takes no training prompt


def test_async_needs_separate_actors(tmp_path):
    job = load_job(write_job(tmp_path), ["placement.colocate=true", "rollout.weight_transport=inprocess"])
    from loongsage_core.controller.async_loop import AsyncLoop
    from loongsage_core.controller.runtime import Run

    with pytest.raises(ConfigError, match="async.enable = true needs placement.colocate = false"):
        AsyncLoop(Run(resolve_job(job), tmp_path / "o"))


HEAVY_TAIL_JOB = f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents", "schedulers"]
[model]
tokenizer = "{REPO / 'tests' / 'data' / 'tokenizer'}"
[model.config]
model_type = "qwen3"
vocab_size = 512
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
max_position_embeddings = 256
tie_word_embeddings = true
[train]
lr = 1e-5
total_steps = 6
mini_batch_size = 16
micro_batch_size = 16
[rollout]
prompts_per_step = 4
samples_per_prompt = 2
max_new_tokens = 64
weight_transport = "shm"
partial = true
[placement]
colocate = false
[async]
enable = true
scheduler = "windowed_fifo"
stale_steps = 1
[[data]]
name = "short"
generator = "arithmetic"
weight = 0.75
sampling = {{ max_new_tokens = 4 }}
[[data]]
name = "long"
generator = "arithmetic"
weight = 0.25
generator_args = {{ seed = 1 }}
sampling = {{ max_new_tokens = 64 }}
"""


PARTIAL = 'async.scheduler_args={staleness="newest", fill="trainable"}'


@pytest.mark.parametrize("scheduler", ["windowed_fifo", "window_gated", "no_window"])
def test_heavy_tailed_run_trains_the_long_generations_within_the_bound(ray_cluster, tmp_path, scheduler):
    # a randomly initialised model rarely stops, so "long" samples run 16 times as long as "short"
    # ones: a scheduler that drops or postpones slow groups trains fewer long samples than it
    # generated (plain no_window, which evicts what got older than the bound, fails these checks).
    # The windows train every generated group within one version of its oldest token; partial
    # rollout (no_window by the newest token, trainable fill) within one version of its last
    # token, the generations continuing across updates. None wastes anything.
    partial = [PARTIAL] if scheduler == "no_window" else []
    job = load_job(write_job(tmp_path, HEAVY_TAIL_JOB), [f"async.scheduler={scheduler}", *partial])
    history = run_job(resolve_job(job), output_dir=str(tmp_path / "run"))
    assert len(history) == 6
    assert all(m["rollout/staleness_max"] <= 1.0 for m in history)
    assert all(m["rollout_per_source/long/groups"] == 1.0 for m in history)  # its quota, every step
    assert all(m["perf/old_logprob_pass_skipped"] == 1.0 for m in history)  # stale rows included
    last = history[-1]
    assert last["rollout/dropped_stale_total"] == last["rollout/dropped_surplus_total"] == 0.0
    assert last["rollout/waste_ratio"] == 0.0 and last["rollout/wasted_tokens_total"] == 0.0
    assert last["rollout/length_trained_p90"] > 8 * 4  # the long samples are in the trained ones
    assert last["rollout/length_ks"] <= 0.05
    assert last["rollout/length_trained_mean"] >= 0.95 * last["rollout/length_sampled_mean"]
