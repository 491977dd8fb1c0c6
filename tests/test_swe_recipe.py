"""The ``swe`` and ``opencode`` recipes (configs/recipes/swe, configs/recipes/opencode): they
validate by name, and two GRPO steps of each run end to end on the tiny agent model (real Ray,
router, engine, sandboxes, swe_tests in each sandbox; the real OpenCode CLI in the second), with the
per-step sandbox and agent metrics the recipes document. The learning job (``recipes/swe/repair``:
the warm-started policy of model/ on generated repositories) runs two steps with its held-out
``[eval]``, and its policy views and edits through the real tools."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parent.parent
SWE = REPO / "configs" / "recipes" / "swe"
OPENCODE = REPO / "configs" / "recipes" / "opencode"
SMALL = ("train.total_steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
         "train.mini_batch_size=4", "train.micro_batch_size=2", "run.checkpoint_every=0", "run.save_hf_at_end=false")
METRICS = ("rollout/sandbox_create_s", "rollout/sandbox_teardown_s", "rollout/tool_calls_mean", "rollout/turns_mean",
           "rollout/agent_failed_ratio", "rollout_per_source/swe/reward/swe_tests/resolved",
           "rollout_per_source/swe/reward/swe_tests/p2p_passed")


def test_swe_recipes_validate_by_name_and_ship_their_files():
    for name in ("recipes/swe", "recipes/opencode", "recipes/swe/repair", "recipes/swe/warm_start"):
        out = subprocess.run([sys.executable, "-m", "loongsage_core", "validate", name], capture_output=True,
                             text=True, cwd=REPO)
        assert out.returncode == 0, f"{name}: {out.stderr or out.stdout}"
        assert f"{name}: OK" in out.stdout, out.stdout
    assert (SWE / "README.md").is_file() and (OPENCODE / "README.md").is_file()
    tool, cli = load_job(SWE / "swe.toml"), load_job(OPENCODE / "opencode.toml")
    assert tool.data[0].agent == "tool_agent" and cli.data[0].agent == "opencode"
    for job in (tool, cli):
        src = job.data[0]
        assert src.reward == ["swe_tests"] and src.sandbox == "local" and job.algorithm.advantage == "grpo"
        assert Path(job.resolve_path(src.path)) == SWE / "tasks.jsonl"
        assert Path(job.resolve_path(src.sandbox_args["base_dir"])) == SWE


def test_swe_recipe_runs_two_steps(ray_cluster, tmp_path):
    out = tmp_path / "swe"
    history = run_job(resolve_job(load_job(SWE / "swe.toml", SMALL)), output_dir=str(out))
    assert len(history) == 2
    for m in history:
        for key in METRICS:
            assert key in m, key
        assert m["rollout/num_trajectories"] == 4.0 and m["rollout/agent_failed_ratio"] == 0.0
        assert m["rollout/turns_mean"] >= 1.0
        assert 0 < m["rollout/sandbox_create_s"] < 30 and 0 < m["rollout/sandbox_teardown_s"] < 30
        # the untouched repositories keep their passing tests: the reward ran on the real checkout
        assert m["rollout_per_source/swe/reward/swe_tests/p2p_passed"] == 1.0
    records = [json.loads(line) for line in gzip.open(out / "rollouts" / "step_000000.jsonl.gz", "rt")]
    assert len(records) == 4
    for r in records:
        why = r["metadata"]["swe_tests"]
        assert why["instance_id"].startswith("loongsage-mini__") and why["outcomes"]
        assert r["metadata"]["sandbox"]["isolation"] in ("bwrap", "netns", "none")


def test_swe_repair_job_runs_two_steps_with_its_heldout_eval(ray_cluster, tmp_path):
    """Two GRPO steps of repair.toml (tiny sizes) with its ``[eval]`` on two held-out repositories at
    the start and the end: the warm-started policy views the module and edits it through the real
    tools in each sandbox, and swe_tests grades every trajectory."""
    out = tmp_path / "repair"
    small = (*SMALL, "rollout.samples_per_prompt=4", "train.mini_batch_size=8", "train.micro_batch_size=8",
             "eval.max_prompts=2", "eval.samples=2", "eval.every=0", "algorithm.filters=[]",
             "algorithm.max_filter_retries=0")
    history = run_job(resolve_job(load_job(SWE / "repair.toml", small)), output_dir=str(out))
    steps = [m for m in history if "rollout/num_trajectories" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/num_trajectories"] == 8.0 and m["rollout/agent_failed_ratio"] == 0.0
        assert m["rollout/tool_calls_mean"] >= 1.0  # the warm start calls the file tools
        assert "rollout_per_source/swe_mini/reward/swe_tests/resolved" in m
    evals = [m for m in history if "eval/heldout/pass@1" in m]
    assert len(evals) == 2 and all(0.0 <= m["eval/heldout/pass@1"] <= 1.0 for m in evals)
    records = [json.loads(line) for line in gzip.open(out / "rollouts" / "step_000000.jsonl.gz", "rt")]
    names = [c["function"]["name"] for r in records for m in r["messages"] for c in (m.get("tool_calls") or [])]
    assert "view" in names and "edit" in names and "bash" not in names
    for r in records:
        assert r["metadata"]["swe_tests"]["instance_id"].startswith("loongsage-mini__")


def test_opencode_recipe_runs_a_step(ray_cluster, tmp_path):
    """The ``opencode`` recipe: OpenCode (installed by scripts/install_agent_clis.sh) inside each sandbox,
    its ~20K-token prompt on the 32K-context tiny model; one prompt x two samples, one step (each
    trajectory costs seconds of training on 2 cores)."""
    out = tmp_path / "opencode"
    small = (*SMALL, "train.total_steps=1", "rollout.prompts_per_step=1", "train.mini_batch_size=2",
             "train.micro_batch_size=1")
    history = run_job(resolve_job(load_job(OPENCODE / "opencode.toml", small)), output_dir=str(out))
    assert len(history) == 1
    for m in history:
        for key in METRICS:
            assert key in m, key
        assert m["rollout/num_trajectories"] == 2.0 and m["rollout/agent_failed_ratio"] == 0.0
    records = [json.loads(line) for line in gzip.open(out / "rollouts" / "step_000000.jsonl.gz", "rt")]
    for r in records:
        assert r["metadata"]["agentflow"]["agent"]["sandboxed"] is True  # the CLI ran inside the sandbox
        assert r["metadata"]["prefix_cache"]["prompt_tokens"] > 8000  # the CLI's own prompt
        assert r["metadata"]["swe_tests"]["outcomes"]
