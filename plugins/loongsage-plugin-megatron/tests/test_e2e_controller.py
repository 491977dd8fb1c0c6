"""The megatron train backend end to end through the host's controller: Ray actors, a colocated
embedded engine, weights pushed every step, a frozen reference model; tensor parallelism 2
against one rank on the same checkpoint and the same rollouts; a LoRA run under tensor
parallelism 2 (the adapter alone is synced, the reference is the base model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "configs" / "quickstart" / "model"  # a real HF checkpoint: 3 layers, 2 KV heads

JOB = """
[plugins]
enable = ["torch", "megatron", "rl", "rewards", "loggers", "agents"]
[model]
path = "{model}"
[train]
backend = "megatron"
backend_args = {{ tp = {tp} }}
num_workers = {tp}
lr = 1e-3
total_steps = 2
mini_batch_size = 32
micro_batch_size = 8
{lora}
[rollout]
prompts_per_step = 4
samples_per_prompt = 8
max_new_tokens = 6
[placement]
colocate = true
[algorithm]
advantage = "grpo"
policy_loss = "ppo_clip"
kl = "k3"
kl_coef = 0.01
[run]
seed = 3
checkpoint_every = 0
save_hf_at_end = true
[[data]]
name = "arithmetic"
generator = "arithmetic"
generator_args = {{ num_samples = 50, digits = 1, num_operands = 2, ops = "+-" }}
reward = ["exact_match"]
[[loggers]]
name = "jsonl"
"""


@pytest.fixture(scope="module")
def ray_cluster(slow_fixture):
    """The session's Ray cluster when one is up (the whole suite), else a small local one for
    this module (the plugin's own test environment)."""
    import ray

    from loongsage_core.controller.placement import start_local_cluster

    started = not ray.is_initialized()
    if started:
        start_local_cluster(num_cpus=4, object_store_mb=128)
    yield ray
    if started:
        ray.shutdown()


def run(tmp_path: Path, tp: int, lora: str = "") -> tuple[list[dict], Path]:
    path = tmp_path / f"tp{tp}{'_lora' if lora else ''}.toml"
    path.write_text(JOB.format(model=MODEL, tp=tp, lora=lora))
    out = tmp_path / path.stem
    run_job(resolve_job(load_job(path)), output_dir=str(out))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], out


def test_megatron_runs_end_to_end_and_tp2_matches_one_rank(ray_cluster, tmp_path):
    one, _ = run(tmp_path, 1)
    two, out = run(tmp_path, 2)
    assert [m["step"] for m in two] == [0, 1]
    for m in (*one, *two):
        # the engine serves exactly the trainer's weights (pushed after every step)
        assert m["train/is_approx_k3_kl"] < 1e-6
        # the frozen reference model (built beside the policy, sharded like it) feeds the KL term
        assert m["train/kl"] >= 0 and "train/kl_loss" in m
    assert two[-1]["perf/weight_version"] == 2.0
    assert two[0]["train/kl"] == pytest.approx(0.0, abs=1e-9)  # before any update: policy == reference
    assert two[1]["train/kl"] > 0
    # same checkpoint, same rollouts at step 0: tensor parallelism changes nothing but rounding
    assert one[0]["rollout/reward_mean"] == two[0]["rollout/reward_mean"]
    assert one[0]["train/grad_norm"] > 0  # some groups had mixed rewards: there was something to learn
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-6), key
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final_hf")
    assert model.config.num_hidden_layers == 3


def test_megatron_lora_under_tp2_syncs_the_adapter_alone(ray_cluster, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    history, out = run(tmp_path, 2, lora="lora = { rank = 4, alpha = 8.0 }")
    assert [m["step"] for m in history] == [0, 1]
    adapter = load_file(str(out / "final_adapter" / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    for m in history:
        # the engine merges the adapter gathered over both tensor-parallel ranks: it serves the
        # trainer's exact model after the first update too
        assert m["train/is_approx_k3_kl"] < 1e-6
        assert m["perf/weight_sync_perf/weight_update_bytes"] == adapter_bytes  # the adapter alone
    # the reference is the base model: at step 0 the adapter is a no-op (B = 0), so the KL is 0
    assert history[0]["train/kl"] == pytest.approx(0.0, abs=1e-9) and history[1]["train/kl"] > 0
    assert any(not torch.all(t == 0) for n, t in adapter.items() if "lora_B" in n)  # the adapter trained
    # the PEFT directory on the base checkpoint and the merged export are the same model
    ids = torch.tensor([[5, 17, 42, 9, 3, 77, 8]])
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
                                                str(out / "final_adapter")).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "final_hf", dtype=torch.float32).eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, peft_logits, rtol=0, atol=1e-4)
