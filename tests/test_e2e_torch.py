"""End to end on the embedded backends: a real local Ray cluster, real HTTP engines, a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parent.parent

JOB = """
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]

[model]
tokenizer = "{tokenizer}"

[model.config]
model_type = "qwen3"
vocab_size = 512
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
max_position_embeddings = 512
tie_word_embeddings = true

[train]
lr = 1e-3
total_steps = 3
mini_batch_size = 8
micro_batch_size = 3

[rollout]
prompts_per_step = 2
samples_per_prompt = 4
max_new_tokens = 6
max_context_length = 256
temperature = 1.0

[placement]
colocate = {colocate}

[run]
seed = 7
checkpoint_every = 1
keep_checkpoints = 5

[[data]]
name = "add"
generator = "arithmetic"
generator_args = {{ num_samples = 16 }}
reward = ["exact_match"]

[[loggers]]
name = "jsonl"
"""


def make_job(tmp_path: Path, colocate: bool, name: str = "job.toml", overrides: tuple[str, ...] = (),
             transport: str | None = "pick"):
    """The job above; ``transport`` None keeps the default (``auto``), "pick" names the plain one."""
    path = tmp_path / name
    path.write_text(JOB.format(tokenizer=REPO / "tests" / "data" / "tokenizer",
                               colocate="true" if colocate else "false"))
    if transport == "pick":
        transport = "inprocess" if colocate else "shm"
    chosen = [f"rollout.weight_transport={transport}"] if transport else []
    return load_job(path, [*chosen, *overrides])


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("colocate, transport", [(True, None), (False, "shm"), (False, "broadcast")])
def test_sync_grpo_run_end_to_end(ray_cluster, tmp_path, colocate, transport):
    job = make_job(tmp_path, colocate, transport=transport)
    out = tmp_path / "run"
    history = run_job(resolve_job(job), output_dir=str(out))
    assert len(history) == 3
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for key in ("rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/pg_loss",
                "train/entropy", "train/grad_norm", "train/clip_ratio", "train/is_approx_k3_kl",
                "timing/step", "timing/rollout", "timing/train", "timing/update_weights"):
        assert key in metrics[-1], key
    # the engine and the trainer compute the same log-probs for the same tokens (fp32)
    assert all(m["train/is_approx_k3_kl"] < 1e-6 for m in metrics)
    assert metrics[-1]["perf/weight_version"] == 3.0
    # the default transport (auto) hands a colocated engine the tensors in-process
    path = {None: "inprocess", "shm": None, "broadcast": None}[transport]
    if path:
        assert metrics[-1][f"perf/weight_sync_perf/weight_targets_{path}"] == 1.0
    # colocated: the engine gave its memory (kv_cache, weights) to the trainer while it trained
    assert all((m.get("perf/engine_memory_released") == 2.0) == colocate for m in metrics)
    assert (out / "config.resolved.toml").exists()
    assert (out / "checkpoints" / "latest").read_text() == "step_000003"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final_hf")
    assert model.config.num_hidden_layers == 2


def test_colocated_offload_does_not_change_training(ray_cluster, tmp_path):
    runs = {}
    for offload in ("true", "false"):
        out = tmp_path / f"offload_{offload}"
        job = make_job(tmp_path, True, f"{offload}.toml", (f"placement.offload={offload}", "train.total_steps=2"))
        run_job(resolve_job(job), output_dir=str(out))
        runs[offload] = read_metrics(out)
    assert "timing/to_training" in runs["true"][0] and "timing/to_training" not in runs["false"][0]
    for on, off in zip(runs["true"], runs["false"]):
        for key in ("rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm"):
            assert on[key] == off[key], key


def test_resume_matches_uninterrupted_run(ray_cluster, tmp_path):
    straight = tmp_path / "straight"
    run_job(resolve_job(make_job(tmp_path, True, "a.toml")), output_dir=str(straight))
    resumed = tmp_path / "resumed"
    run_job(resolve_job(make_job(tmp_path, True, "b.toml", ("train.total_steps=2",))), output_dir=str(resumed))
    run_job(resolve_job(make_job(tmp_path, True, "c.toml", ("run.resume=true",))), output_dir=str(resumed))

    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in b] == [0, 1, 2]
    for ma, mb in zip(a, b):
        assert ma["rollout/reward_mean"] == mb["rollout/reward_mean"]
        assert ma["rollout/response_length_mean"] == mb["rollout/response_length_mean"]
    ca = json.loads((straight / "checkpoints" / "step_000003" / "controller.json").read_text())
    cb = json.loads((resumed / "checkpoints" / "step_000003" / "controller.json").read_text())
    assert ca["data"] == cb["data"]  # the same prompts were consumed
    wa = load_file(straight / "final_hf" / "model.safetensors")
    wb = load_file(resumed / "final_hf" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k] - wb[k]).abs().max() < 1e-5, k


def test_data_parallel_trainers_with_separate_engines(ray_cluster, tmp_path):
    job = make_job(tmp_path, False, overrides=("train.num_workers=2", "rollout.num_engines=1",
                                               "train.total_steps=2"))
    out = tmp_path / "dp"
    history = run_job(resolve_job(job), output_dir=str(out))
    assert len(history) == 2
    assert all(m["train/is_approx_k3_kl"] < 1e-6 for m in history)  # both ranks stay in sync with the engine
    assert (out / "checkpoints" / "step_000002" / "trainer" / "rng_rank1.pt").is_file()
    # both ranks resume from the shared checkpoint and train one more step
    more = make_job(tmp_path, False, "more.toml", ("train.num_workers=2", "rollout.num_engines=1",
                                                   "train.total_steps=3", "run.resume=true"))
    resumed = run_job(resolve_job(more), output_dir=str(out))
    assert len(resumed) == 1 and resumed[0]["step"] == 2
    # each run reserved its actors in a placement group (one bundle per actor) and released it
    from ray.util import placement_group_table

    groups = list(placement_group_table().values())
    assert groups and all(g["state"] == "REMOVED" for g in groups)
    assert any(len(g["bundles"]) == 3 for g in groups)  # 2 trainer ranks + 1 engine


def test_prompt_longer_than_context_is_a_clear_error(ray_cluster, tmp_path):
    from loongsage_core.config import ConfigError

    job = make_job(tmp_path, True, overrides=("rollout.max_context_length=20",))
    with pytest.raises(ConfigError, match=r"prompt 'add/\d+' has \d+ tokens, more than the 14 that "
                                          r"rollout.max_context_length \(20\) leaves after max_new_tokens"):
        run_job(resolve_job(job), output_dir=str(tmp_path / "ctx"))


def test_missing_model_directory_is_reported_by_the_cli(tmp_path):
    import subprocess
    import sys

    job = tmp_path / "job.toml"
    job.write_text('[plugins]\nenable = ["torch", "rl", "rewards", "loggers", "agents"]\n'
                   '[model]\npath = "no/such/model"\n[[data]]\nname = "a"\ngenerator = "arithmetic"\n')
    out = subprocess.run([sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir",
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"model.path: '{tmp_path / 'no' / 'such' / 'model'}' does not exist" in out.stderr
