"""The recipes in configs/recipes/: each validates with the CLI, and the critic recipe (PPO with
GAE and a value model), DAPO, GRPO with LoRA and the folder recipes (math_dapo, mopd: their own data and tiny
models, built by scripts/make_recipe_models.py) run end to end on a real local Ray cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from loongsage_core.config import ConfigError, load_job
from loongsage_core.controller.critic import check_critic_resources
from loongsage_core.controller.run import run_job
from loongsage_core.records import read_rollouts
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "configs" / "recipes"
EXPECTED = {"grpo", "grpo_lora", "dapo", "dr_grpo", "gspo", "rloo", "reinforce_pp", "ppo_critic"}
SMALL = ("train.total_steps=2", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "train.mini_batch_size=16", "train.micro_batch_size=8", "run.checkpoint_every=1", "run.keep_checkpoints=3")


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_every_recipe_validates_with_the_cli():
    names = {p.stem for p in RECIPES.glob("*.toml")}
    assert EXPECTED <= names, f"missing recipes: {sorted(EXPECTED - names)}"
    for path in sorted(RECIPES.glob("*.toml")):
        out = subprocess.run([sys.executable, "-m", "loongsage_core", "validate", str(path)],
                             capture_output=True, text=True)
        assert out.returncode == 0, f"{path.name}: {out.stderr or out.stdout}"
        assert f"{path}: OK" in out.stdout, out.stdout


def test_recipes_pick_their_algorithms():
    jobs = {p.stem: load_job(p) for p in RECIPES.glob("*.toml")}
    sft = jobs.pop("sft")  # the supervised recipe (loongsage sft): chat data, no algorithm
    assert sft.sft is not None and sft.sft.loss_on == "assistant" and sft.sft.packing
    assert Path(sft.resolve_path(sft.model.path)) == REPO / "configs" / "quickstart" / "model"
    assert all(job.sft is None for job in jobs.values())
    for name, job in jobs.items():
        assert Path(job.resolve_path(job.model.path)) == REPO / "configs" / "quickstart" / "model", name
        assert [d.generator for d in job.data] == ["arithmetic"], name
    dapo = jobs["dapo"].algorithm
    assert dapo.policy_loss_args["clip_high"] == 0.28 and dapo.filters == ["dynamic_sampling"]
    assert dapo.max_filter_retries > 0 and dapo.loss_agg == "token_mean"
    assert "overlong_penalty" in jobs["dapo"].data[0].reward
    assert (jobs["dr_grpo"].algorithm.advantage, jobs["dr_grpo"].algorithm.loss_agg) == ("dr_grpo",
                                                                                         "seq_mean_token_sum_norm")
    assert jobs["gspo"].algorithm.policy_loss == "gspo"
    assert jobs["rloo"].algorithm.advantage == "rloo"
    assert jobs["reinforce_pp"].algorithm.advantage == "reinforce_pp"
    assert jobs["ppo_critic"].algorithm.advantage == "gae"
    assert resolve_job(jobs["ppo_critic"]).host.get("advantage", "gae").needs_critic


def test_ppo_critic_recipe_trains_checkpoints_and_resumes_the_critic(ray_cluster, tmp_path):
    out = tmp_path / "ppo"
    recipe = RECIPES / "ppo_critic.toml"
    history = run_job(resolve_job(load_job(recipe, [*SMALL, "run.save_hf_at_end=false"])), output_dir=str(out))
    assert len(history) == 2
    first, second = read_metrics(out)
    for key in ("train/critic_loss", "train/value_mean", "train/value_clip_frac", "train/explained_variance",
                "train/critic_grad_norm", "train/pg_loss"):
        assert key in second, key
    # a fresh critic (zero value head) predicts 0: GAE then sees no baseline at step 0
    assert first["train/value_mean"] == 0.0 and first["train/explained_variance"] == 0.0
    assert second["train/value_mean"] != 0.0  # the critic was trained after step 0
    assert first["train/critic_loss"] > 0
    for step in (1, 2):
        d = out / "checkpoints" / f"step_{step:06d}"
        assert (d / "trainer" / "trainer_state.pt").is_file() and (d / "critic_rank_0" / "trainer_state.pt").is_file()

    # resume at step 2: the critic comes back from critic_rank_0 (a fresh one would predict 0)
    history = run_job(resolve_job(load_job(recipe, [*SMALL, "train.total_steps=3", "run.resume=true"])),
                      output_dir=str(out))
    assert [m["step"] for m in history] == [2]
    assert history[0]["train/value_mean"] != 0.0
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2]
    assert (out / "checkpoints" / "step_000003" / "critic_rank_0").is_dir()


def test_dapo_recipe_runs_end_to_end(ray_cluster, tmp_path):
    out = tmp_path / "dapo"
    job = load_job(RECIPES / "dapo.toml", [*SMALL, "run.checkpoint_every=0", "run.save_hf_at_end=false"])
    history = run_job(resolve_job(job), output_dir=str(out))
    assert len(history) == 2
    for m in history:
        assert m["rollout/filter_attempts"] >= 1
        assert m["rollout/groups_trained"] <= 4
        assert "rollout_per_source/arithmetic/reward/overlong_penalty/score" in m
        assert m["rollout_per_source/arithmetic/reward/overlong_penalty/score"] <= 0.0
        assert m["train/clip_ratio"] >= 0.0


@pytest.mark.parametrize("lora_mode", ["merged", "unmerged"])
def test_grpo_lora_recipe_trains_the_adapter_alone(ray_cluster, tmp_path, lora_mode):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "grpo_lora"
    job = load_job(RECIPES / "grpo_lora.toml", [*SMALL, f'rollout.engine_args.lora_mode="{lora_mode}"'])
    assert job.train.lora is not None and job.algorithm.kl
    history = run_job(resolve_job(job), output_dir=str(out))
    assert [m["step"] for m in history] == [0, 1]
    # the engine's sampling log-probs are the trainer's, the adapter merged or applied per request
    assert all(m["train/is_approx_k3_kl"] < 1e-6 for m in history)
    # the reference is the base model: at step 0 the adapter is a no-op (B = 0), so the KL is 0
    assert history[0]["train/kl"] == 0.0 and history[1]["train/kl"] > 0.0
    adapter = load_file(str(out / "final_adapter" / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    merged = load_file(str(out / "final_hf" / "model.safetensors"))
    assert adapter_bytes < sum(t.numel() * t.element_size() for t in merged.values()) / 4
    for m in history:  # only the adapter goes to the engine
        assert m["perf/weight_sync_perf/weight_update_bytes"] == adapter_bytes
    assert not any(".lora_" in name for name in merged)
    state = torch.load(out / "checkpoints" / "step_000002" / "trainer" / "trainer_state.pt", weights_only=True)
    assert state["weights"] == "adapter" and set(state["model"]) and all(".lora_" in n for n in state["model"])
    assert any(not torch.all(t == 0) for n, t in adapter.items() if "lora_B" in n)  # the adapter trained


def test_critic_resources_are_checked_before_starting(tmp_path):
    job = load_job(RECIPES / "ppo_critic.toml")
    check_critic_resources(job, {"CPU": 2.0})  # trainer 1 + critic 1
    with pytest.raises(ConfigError, match=r"the critic needs 2 CPU on top of the 1 .* lower critic.cpus"):
        check_critic_resources(load_job(RECIPES / "ppo_critic.toml", ["critic.num_workers=2"]), {"CPU": 2.0})
    with pytest.raises(ConfigError, match="critic needs 1 GPU"):
        check_critic_resources(load_job(RECIPES / "ppo_critic.toml", ["critic.gpus=1"]), {"CPU": 8.0})


FOLDER_RECIPES = ("math_dapo", "mopd", "swe", "opencode", "opencode_learn", "moe_r3", "verifiers", "vision_count")


@pytest.mark.slow
def test_folder_recipes_validate_by_name_and_ship_their_files(capsys, monkeypatch):
    from loongsage_core.cli import main

    monkeypatch.chdir(REPO)
    for name in FOLDER_RECIPES:  # `loongsage validate recipes/NAME`, in this process
        folder = RECIPES / name
        assert (folder / "README.md").is_file() and (folder / f"{name}.png").is_file(), name
        code = main(["validate", f"recipes/{name}"])
        out = capsys.readouterr()
        assert code == 0, f"{name}: {out.err or out.out}"
        assert f"recipes/{name}: OK" in out.out, out.out
    dapo = load_job(RECIPES / "math_dapo" / "math_dapo.toml")
    assert Path(dapo.resolve_path(dapo.model.path)) == RECIPES / "math_dapo" / "model"
    assert dapo.algorithm.filters == ["dynamic_sampling"] and dapo.algorithm.policy_loss_args["clip_high"] == 0.28
    assert dapo.data[0].reward == ["math_verify", "overlong_penalty"]
    rows = [json.loads(line) for line in Path(dapo.resolve_path(dapo.data[0].path)).read_text().splitlines()]
    assert len(rows) >= 1000 and all(r["label"].lstrip("-").isdigit() for r in rows)
    mopd = load_job(RECIPES / "mopd" / "mopd.toml")
    assert mopd.algorithm.distill_kl == "opd_full_kl" and mopd.placement.max_resident_teachers == 1
    assert [t.name for t in mopd.teachers] == ["add", "sub"]
    assert [(d.name, d.teacher) for d in mopd.data] == [("addition", "add"), ("subtraction", "sub")]
    for teacher in mopd.teachers:
        assert (Path(mopd.resolve_path(teacher.path)) / "model.safetensors").is_file(), teacher.name


def test_math_dapo_recipe_runs_two_steps(ray_cluster, tmp_path):
    out = tmp_path / "math_dapo"
    job = load_job(RECIPES / "math_dapo" / "math_dapo.toml",
                   [*SMALL, "run.checkpoint_every=0", "run.save_hf_at_end=false"])
    run_job(resolve_job(job), output_dir=str(out))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1]
    source = "rollout_per_source/word_problems/reward"
    for m in metrics:
        assert m["rollout/filter_attempts"] >= 1 and m["rollout/groups_trained"] <= 4
        assert 0.0 <= m[f"{source}/math_verify/score"] <= 1.0
        assert m[f"{source}/overlong_penalty/score"] <= 0.0
    # the warm-started model answers some problems right: math_verify is not stuck at 0
    assert max(m[f"{source}/math_verify/score"] for m in metrics) > 0.0


def test_moe_r3_recipe_replays_the_bf16_engines_routing_in_the_fp32_trainer(ray_cluster, tmp_path):
    """Controller -> engine (bfloat16, returning its routed experts) -> trainer (float32, replaying
    them) -> loss: with replay the trainer uses the engine's experts everywhere, and the gap to the
    engine's log-probs is lower than the same rows give without replay wherever routing differed."""
    out = tmp_path / "moe_r3"
    job = load_job(RECIPES / "moe_r3" / "moe_r3.toml", [*SMALL, "train.total_steps=3", "run.checkpoint_every=0",
                                                        "run.save_hf_at_end=false"])
    assert job.algorithm.router_replay and job.model.dtype == "float32"
    assert job.rollout.engine_args["dtype"] == "bfloat16"
    run_job(resolve_job(job), output_dir=str(out))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["train/router_agreement"] == 1.0 for m in metrics)
    assert all(m["perf/old_logprob_pass_skipped"] == 0.0 for m in metrics)  # the comparison needs the pass
    flipped = [m for m in metrics if m["train/router_agreement_no_replay"] < 1.0]
    assert flipped, "bfloat16 and float32 routed every token alike: nothing to replay"
    for m in metrics:
        replayed, own = m["train/is_approx_k3_kl"], m["train/is_approx_k3_kl_no_replay"]
        assert replayed > 0.0  # bf16 against fp32: a gap remains, routing apart
        if m["train/router_agreement_no_replay"] == 1.0:
            assert replayed == own  # the same experts: replay changes nothing, bit for bit
    assert sum(m["train/is_approx_k3_kl"] for m in flipped) < sum(m["train/is_approx_k3_kl_no_replay"] for m in flipped)


def test_mopd_recipe_runs_two_steps(ray_cluster, tmp_path):
    out = tmp_path / "mopd"
    job = load_job(RECIPES / "mopd" / "mopd.toml", [*SMALL, "run.checkpoint_every=0", "run.save_hf_at_end=false"])
    run_job(resolve_job(job), output_dir=str(out))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["train/opd_kl"] > 0.0
        for teacher in ("add", "sub"):
            assert m[f"train_per_teacher/{teacher}/opd_kl"] > 0.0, teacher
        assert m["rollout_per_source/addition/count"] == m["rollout_per_source/subtraction/count"] == 8.0


def test_verifiers_recipe_runs_two_steps_and_evaluates_the_held_out_split(ray_cluster, tmp_path):
    """The verifiers recipe: vf_arithmetic's episodes played by verifiers' own harness program and
    scoring through the run's router, held-out evaluation on the environment's eval split."""
    out = tmp_path / "verifiers"
    job = load_job(RECIPES / "verifiers" / "verifiers.toml",
                   ["train.total_steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                    "train.mini_batch_size=4", "train.micro_batch_size=4", "run.checkpoint_every=0",
                    "run.save_hf_at_end=false", "eval.max_prompts=2", "eval.samples=1"])
    assert Path(job.resolve_path(job.model.path)) == REPO / "configs" / "quickstart" / "model"
    assert [(d.generator_args["env"], d.generator_args["split"]) for d in (*job.data, *job.eval.data)] == \
        [("vf_arithmetic", "train"), ("vf_arithmetic", "eval")]
    run_job(resolve_job(job), output_dir=str(out))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]  # step 2: the evaluation after the last step
    for m in metrics[:2]:
        assert m["rollout/failed_ratio"] == 0.0 and m["rollout/num_trajectories"] == 4.0
        assert 0.0 <= m["rollout_per_source/vf_arithmetic/reward/verifiers/correct"] <= 1.0
    for m in (metrics[0], metrics[2]):
        assert m["eval/vf_arithmetic_eval/prompts"] == 2.0 and m["eval/vf_arithmetic_eval/failed_ratio"] == 0.0
        assert 0.0 <= m["eval/vf_arithmetic_eval/pass@1"] <= 1.0


def test_vision_count_recipe_runs_two_steps(ray_cluster, tmp_path):
    """The vision-language recipe: picture prompts through the router, image records, the trainer on
    the rebuilt pixels (its old log-probs agree with the engine's), one training source per question
    with a reward that is not stuck at 0, and the held-out evaluation per question on label-balanced
    pictures that training never shows."""
    folder = RECIPES / "vision_count"
    rows = {name: [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
            for name in ("shapes_count", "shapes_colour", "heldout_count", "heldout_colour")}
    pictures = {name: {r["prompt"][0]["content"][0]["image_url"]["url"] for r in got} for name, got in rows.items()}
    trained = pictures["shapes_count"] | pictures["shapes_colour"]
    assert not trained & (pictures["heldout_count"] | pictures["heldout_colour"])
    for name, answers in (("heldout_count", "1234"), ("heldout_colour", "bgry")):
        labels = Counter(r["label"] for r in rows[name])  # balanced: a shifted answer prior scores 0.25
        assert sorted(labels) == list(answers) and len(set(labels.values())) == 1, labels
    out = tmp_path / "vision_count"
    job = load_job(folder / "vision_count.toml", [*SMALL, "run.checkpoint_every=0", "run.save_hf_at_end=false",
                                                  "eval.max_prompts=4", "eval.samples=2"])
    run_job(resolve_job(job), output_dir=str(out))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]  # step 2: the evaluation after the last step
    assert all(m["rollout/num_rows"] == 16.0 and m["train/is_approx_k3_kl"] < 1e-6 for m in metrics[:2])
    # the partly-right warm start samples the right answer about half the time, on each question
    for source in ("count", "colour"):
        assert max(m[f"rollout_per_source/{source}/reward/exact_match/score"] for m in metrics[:2]) > 0.0
    for m in (metrics[0], metrics[2]):
        for source in ("count", "colour"):
            assert m[f"eval/{source}/prompts"] == 4.0 and m[f"eval/{source}/failed_ratio"] == 0.0
            assert 0.0 <= m[f"eval/{source}/pass@1"] <= 1.0
    records = [r for step in (0, 1) for r in read_rollouts(out, step)]
    assert any(r.get("eval") for r in records) and any(not r.get("eval") for r in records)
    assert all(len(r["images"]) == 1 and r["segments"][0]["images"] for r in records)
