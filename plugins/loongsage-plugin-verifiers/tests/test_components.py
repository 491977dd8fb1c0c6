"""The verifiers plugin's components without an engine: the data source's rows, the errors
``loongsage validate`` gives for a missing or broken environment, and the reward's reading of an
episode's outcome. (Episodes against the real router and engine: tests/test_verifiers_training.py
and the component matrix.)"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from loongsage_core.config import ConfigError, load_job
from loongsage_core.plugins import PluginHost
from loongsage_core.resolve import resolve_job
from loongsage_hookspecs import BuildContext, ComponentRef, Trajectory

JOB = """
[plugins]
enable = ["torch", "rl", "loggers", "verifiers"]

[model]
path = "{model}"

[[data]]
name = "vf"
generator = "verifiers"
generator_args = {generator_args}
agent = "verifiers"
agent_args = {agent_args}
reward = ["verifiers"]
"""

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.create(["verifiers"])


def rows(host: PluginHost, **args):
    ref = ComponentRef("data_source", "verifiers", args, where="data[0].generator", args_where="data[0].generator_args")
    return list(host.bind(ref, BuildContext(components=host)))


def validate(tmp_path: Path, generator_args: str, agent_args: str = "{}") -> None:
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(model=REPO / "configs" / "quickstart" / "model", generator_args=generator_args,
                               agent_args=agent_args))
    resolve_job(load_job(path))  # what `loongsage validate` runs


def test_rows_carry_the_task_and_the_splits_are_disjoint(host):
    train = rows(host, env="vf_arithmetic")
    held_out = rows(host, env="vf_arithmetic", split="eval")
    assert (len(train), len(held_out)) == (160, 40)
    prompts = {r["prompt"][0]["content"] for r in train}
    assert not prompts & {r["prompt"][0]["content"] for r in held_out}
    row = train[0]
    a, op, b = row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split()
    assert row["prompt"] == [{"role": "user", "content": f"What is {a} {op} {b}?"}]
    assert row["label"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
    meta = row["metadata"]["verifiers"]
    assert meta["env"] == "vf_arithmetic" and meta["env_args"] == {"taskset": {"split": "train"}}
    assert meta["task"]["answer"] == row["label"] and meta["task"]["idx"] == meta["idx"] == 0
    # verifiers' own selection, and its rebuild of the task from the row
    assert len(rows(host, env="vf_arithmetic", select={"include": {"idx": ["0:10"]}, "limit": 4})) == 4
    from loongsage_plugin_verifiers.envs import load_env, rebuild_task

    task = rebuild_task(load_env("vf_arithmetic", meta["env_args"]), meta["task"])
    assert task.key == meta["key"] and task.data.answer == row["label"]


def test_task_fields_of_every_kind_reach_the_rows(host):
    (guess,) = rows(host, env="vf_guess", num_samples=1)
    assert guess["label"] is None and guess["metadata"]["verifiers"]["task"]["secret"] == 3
    assert [r["metadata"]["verifiers"]["task"]["target"] for r in rows(host, env="vf_tally")] == [2, 1, 3]


def test_a_missing_environment_is_a_validate_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate(tmp_path, '{ env = "vf_no_such_env" }')
    message = str(err.value)
    assert "data[0].generator_args" in message and "'vf_no_such_env'" in message
    assert "ModuleNotFoundError" in message
    with pytest.raises(ConfigError) as err:
        validate(tmp_path, '{ env = "vf_arithmetic" }', '{ env = "vf_no_such_env" }')
    assert "data[0].agent_args" in str(err.value) and "'vf_no_such_env'" in str(err.value)


def test_a_broken_environment_is_a_validate_error_with_its_cause(tmp_path, monkeypatch):
    (tmp_path / "vf_broken_env.py").write_text(textwrap.dedent('''
        import verifiers.v1 as vf
        raise RuntimeError("the dataset file is missing")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        validate(tmp_path, '{ env = "vf_arithmetic" }', '{ env = "vf_broken_env" }')
    assert "data[0].agent_args" in str(err.value) and "the dataset file is missing" in str(err.value)


def test_bad_settings_are_validate_errors(tmp_path):
    # verifiers' own config validation: an unknown key of the env's config
    with pytest.raises(ConfigError, match=r"data\[0\]\.generator_args.*'vf_arithmetic'.*no_such_key"):
        validate(tmp_path, '{ env = "vf_arithmetic", env_args = { taskset = { no_such_key = 1 } } }')
    # a taskset without a split setting has no held-out tasks
    with pytest.raises(ConfigError, match=r"'vf_guess'.*no 'split' setting.*select"):
        validate(tmp_path, '{ env = "vf_guess", split = "eval" }')
    with pytest.raises(ConfigError, match=r"split must be one of train, eval"):
        validate(tmp_path, '{ env = "vf_arithmetic", split = "test" }')
    validate(tmp_path, '{ env = "vf_guess", env_args = { max_guesses = 2 } }', '{ env = "vf_guess" }')


def test_the_reward_is_the_environments_score_with_each_function_as_a_detail():
    from loongsage_plugin_verifiers.outcome import verifiers_reward

    outcome = {"env": "vf_x", "reward": 1.5, "rewards": {"correct": 1.0, "style": 0.25}, "weights": {"style": 2.0},
               "metrics": {"answered": 1.0, "correct": 0.0}, "stop": "agent_completed"}
    traj = Trajectory(id="t", prompt_id="p", group_id="g",
                      metadata={"agentflow": {"agent": {"verifiers": outcome}}})
    reward = verifiers_reward(traj)
    assert reward.score == 1.5
    assert reward.details == {"correct": 1.0, "style": 0.25, "answered": 1.0, "metric_correct": 0.0}
    assert "style=0.25 (x2)" in reward.reason and "agent_completed" in reward.reason
    with pytest.raises(ValueError, match="agent = 'verifiers'"):
        verifiers_reward(Trajectory(id="t", prompt_id="p", group_id="g", metadata={"agentflow": {"agent": {}}}))
