"""The ``opencode_learn`` recipe (configs/recipes/opencode_learn): the real OpenCode CLI, configured by
the job to a short prompt and the write tool, learns to create files to a spec.

Its tasks' splits share no word; the job validates by name; two GRPO steps run end to end through
the real CLI in sandboxes, and OpenCode's real first request is, token for token, what the warm
start's transcripts (scripts/make_opencode_learn_recipe.py) render for the same session.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from pathlib import Path

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs" / "recipes" / "opencode_learn"
SMALL = ("train.total_steps=1", "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2",
         "train.mini_batch_size=2", "train.micro_batch_size=2", "algorithm.max_filter_retries=0",
         "run.checkpoint_every=0", "run.save_hf_at_end=false", "eval.max_prompts=1", "eval.samples=1",
         "eval.every=0", "eval.at_end=false")


def build_script():
    spec = importlib.util.spec_from_file_location("make_opencode_learn_recipe",
                                                  REPO / "scripts" / "make_opencode_learn_recipe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (RECIPE / name).read_text().splitlines()]


def test_recipe_validates_and_its_held_out_tasks_use_unseen_words(capsys, monkeypatch):
    from loongsage_core.cli import main

    monkeypatch.chdir(REPO)
    for name in ("recipes/opencode_learn", "recipes/opencode_learn/warm_start"):  # `loongsage validate NAME`
        code = main(["validate", name])
        out = capsys.readouterr()
        assert code == 0 and f"{name}: OK" in out.out, out.err or out.out
    script = build_script()
    train, heldout = rows("train.jsonl"), rows("heldout.jsonl")
    assert train == script.task_rows("train", len(train), 0) and heldout == script.task_rows("heldout", len(heldout), 0)

    def words(rs):
        return {w for r in rs for w in re.split(r"[ _.]", r["file"].rsplit(".", 1)[0] + " " + r["content"])}

    assert not words(train) & words(heldout)
    assert not words(heldout) & set(script.words("train")) and not words(heldout) & set(script.words("tokenizer"))
    # the warm start's transcripts never name a held-out word either
    calls = [tc for r in script.transcripts("train", 300, 0, 0.5) for m in r["messages"]
             for tc in m.get("tool_calls") or []]
    sft = {w for tc in calls for w in re.split(r'[ _."{}:,]', tc["function"]["arguments"])}
    assert len(sft) > 500 and not words(heldout) & sft
    job = load_job(RECIPE / "opencode_learn.toml")
    build = job.data[0].agent_args["config"]["agent"]["build"]
    assert build["prompt"] == script.AGENT_PROMPT == job.eval.data[0].agent_args["config"]["agent"]["build"]["prompt"]


def test_recipe_runs_a_step_through_the_real_cli(ray_cluster, tmp_path):
    out = tmp_path / "opencode_learn"
    history = run_job(resolve_job(load_job(RECIPE / "opencode_learn.toml", SMALL)), output_dir=str(out))
    steps = [m for m in history if "rollout/num_trajectories" in m]
    assert len(steps) == 1
    for m in steps:
        assert m["rollout/agent_failed_ratio"] == 0.0 and m["rollout/num_trajectories"] == 2.0
        assert m["rollout/turns_mean"] >= 1.0
        assert "rollout_per_source/files/reward/swe_tests/resolved" in m
    assert "eval/heldout/pass@1" in history[0]  # the held-out [eval] before the first step
    script = build_script()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(RECIPE / "model"))
    tools = json.loads((RECIPE / "opencode_tools.json").read_text())
    records = [json.loads(line) for line in gzip.open(out / "rollouts" / "step_000000.jsonl.gz", "rt")]
    for r in records:
        assert r["metadata"]["agentflow"]["agent"]["sandboxed"] is True  # the CLI ran inside the sandbox
        first = r["segments"][0]
        prompt = tokenizer.decode(first["tokens"][:first["turns"][0][0]])
        assert len(first["tokens"]) < 1024  # the config's short prompt and two tools, not OpenCode's ~20K tokens
        # the request OpenCode sent is the warm start's transcript format: same system prompt (its
        # working directory and date aside), tools, and the task quoted as OpenCode quotes it
        workdir = re.search(r"Working directory: (\S+)", prompt).group(1)
        date = re.search(r"Today's date: (.+)", prompt).group(1)
        messages = [{"role": "system", "content": script.system_prompt(workdir, date)},
                    {"role": "user", "content": f'"{r["prompt"]}"'}]
        expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert prompt == expected
