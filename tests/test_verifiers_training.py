"""Training on verifiers environments (loongsage-plugin-verifiers) on a real local Ray cluster: two
steps per kind of environment shipped for the tests (``plugins/loongsage-plugin-verifiers/tests/envs``):
single-turn arithmetic, a stateful tool, a multi-turn guessing game. Each trajectory is one episode
of the environment played by its own code (harness program, interception, scoring) against the
run's AgentFlow router and embedded engine."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from loongsage_core import read_rollouts
from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parent.parent
QUICKSTART_MODEL = REPO / "configs" / "quickstart" / "model"
TOKENIZER_DIR = REPO / "tests" / "data" / "tokenizer"


def tool_call_model_dir(root: Path) -> Path:
    """``tool_call_model`` of tests/agentflow/conftest.py (after any generation prompt it writes
    ``<tool_call>{"name": "add"}</tool_call>``), saved as a model directory under ``root``."""
    spec = importlib.util.spec_from_file_location("_agentflow_conftest", REPO / "tests" / "agentflow" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from transformers import AutoTokenizer

    model_dir = root / "tool_model"
    module.tool_call_model(AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))).save_pretrained(str(model_dir))
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, model_dir / f.name)
    return model_dir

JOB = """
[plugins]
enable = ["torch", "rl", "loggers", "agents", "verifiers"]

[model]
path = "{model}"

[train]
lr = 1e-4
total_steps = 2
mini_batch_size = 4
micro_batch_size = 4

[rollout]
prompts_per_step = {prompts}
samples_per_prompt = 2
max_new_tokens = {max_new_tokens}
weight_transport = "inprocess"

[agentflow]
agent_timeout_s = 300
{middleware}

[[data]]
name = "{env}"
generator = "verifiers"
generator_args = {{ env = "{env}", env_args = {env_args} }}
agent = "verifiers"
reward = ["verifiers"]

[[loggers]]
name = "jsonl"
"""


def train(tmp_path: Path, env: str, *, model: Path = QUICKSTART_MODEL, prompts: int = 1, max_new_tokens: int = 8,
          env_args: str = "{}", middleware: str = "") -> tuple[list[dict], list[dict]]:
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(model=model, prompts=prompts, max_new_tokens=max_new_tokens, env=env,
                               env_args=env_args, middleware=middleware))
    out = tmp_path / "run"
    history = run_job(resolve_job(load_job(path)), output_dir=str(out))
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    records = [r for step in (0, 1) for r in read_rollouts(out, step)]
    return history, records


def check_common(history: list[dict], records: list[dict], env: str, n: int) -> None:
    """Every trajectory completed, was scored by the environment and trained on."""
    assert len(history) == 2
    for m in history:
        assert m["rollout/num_trajectories"] == float(n)
        assert m["rollout/failed_ratio"] == 0.0
    assert len(records) == 2 * n
    for rec in records:
        assert rec["status"] in ("ok", "truncated"), rec["error"]
        assert rec["agent"] == "verifiers" and rec["trained"]
        outcome = rec["metadata"]["agentflow"]["agent"]["verifiers"]
        assert outcome["env"] == env
        # the reward is the environment's own score, each function a detail
        assert rec["reward"]["score"] == pytest.approx(outcome["reward"])
        for name, value in outcome["rewards"].items():
            assert rec["reward"]["details"][f"verifiers/{name}"] == pytest.approx(value)


def test_single_turn_environment_trains(ray_cluster, tmp_path):
    history, records = train(tmp_path, "vf_arithmetic")
    check_common(history, records, "vf_arithmetic", 2)
    for m in history:
        # the rubric's functions are logged per source: the reward and the metric
        assert 0.0 <= m["rollout_per_source/vf_arithmetic/reward/verifiers/correct"] <= 1.0
        assert "rollout_per_source/vf_arithmetic/reward/verifiers/answered" in m
    for rec in records:
        # one model turn of the row's question, scored on its own last integer
        assert [msg["role"] for msg in rec["messages"]] == ["user", "assistant"]
        assert rec["messages"][0]["content"] == rec["prompt"][0]["content"]
        assert len(rec["turns"]) == 1 and rec["response_length"] <= 8
        from vf_arithmetic import last_integer

        expected = float(last_integer(rec["response_text"]) == int(rec["label"]))
        assert rec["reward"]["details"]["verifiers/correct"] == expected


def test_tool_environment_trains_with_tool_results_masked(ray_cluster, tmp_path):
    # the policy calls `add` every turn; the seat's max_turns = 2 serves two turns: the harness runs
    # both calls, and the third turn, which would carry the second result, is refused
    history, records = train(tmp_path, "vf_tally", model=tool_call_model_dir(tmp_path), max_new_tokens=16,
                             env_args="{ agent = { max_turns = 2 } }",
                             middleware='middleware = ["tool_call_parser"]\n'
                                        'middleware_args = { tool_call_parser = { format = "hermes" } }')
    check_common(history, records, "vf_tally", 2)
    for m in history:
        assert m["rollout_per_source/vf_tally/reward/verifiers/tool_calls"] == 1.0
    for rec in records:
        assert [c["name"] for c in rec["tool_calls"]] == ["add", "add"]
        assert [c["output"] for c in rec["tool_calls"]] == ["total: 1", None]
        outcome = rec["metadata"]["agentflow"]["agent"]["verifiers"]
        assert outcome["stop"] == "max_turns" and outcome["turns"] == 2
        # the tool results reached the model as prompt tokens of the next turn, never trained on
        (seg,) = rec["segments"]
        masked = "".join(t for t, m in zip(seg["token_text"], seg["loss_mask"]) if m == 0)
        trained = "".join(t for t, m in zip(seg["token_text"], seg["loss_mask"]) if m == 1)
        assert masked.count("total: 1") == 1 and "total" not in trained
        assert trained.count("<tool_call>") == 2
        # the tool server kept the tally (2) in the rollout's state, and the reward read it back
        target = rec["metadata"]["verifiers"]["task"]["target"]
        assert rec["reward"]["details"]["verifiers/reached"] == float(target == 2)


def test_multi_turn_game_trains(ray_cluster, tmp_path):
    history, records = train(tmp_path, "vf_guess", env_args="{ max_guesses = 3 }")
    check_common(history, records, "vf_guess", 2)
    from vf_guess import guess_of

    for rec in records:
        roles = [msg["role"] for msg in rec["messages"]]
        assert roles[0] == "user" and roles[1::2] == ["assistant"] * (len(roles) // 2)
        secret = rec["metadata"]["verifiers"]["task"]["secret"]
        guesses = [guess_of(m["content"] or "") for m in rec["messages"] if m["role"] == "assistant"]
        assert 1 <= len(guesses) <= 3 and len(rec["turns"]) == len(guesses)
        # the environment's replies are user turns: prompt tokens, not trained
        for hint in [m["content"] for m in rec["messages"][2::2]]:
            assert hint in ("Higher.", "Lower.", "Answer with one number from 0 to 9.")
        assert (guesses[-1] == secret) == (rec["reward"]["details"]["verifiers/won"] == 1.0)
        assert rec["reward"]["details"]["verifiers/guesses"] == float(len(guesses))
