import pytest
from loongsage_plugin_rewards.rgym import reasoning_gym_reward, reasoning_gym_rows

from loongsage_hookspecs import Trajectory


def _traj(row, response):
    return Trajectory(id="t", prompt_id="p", group_id="g", prompt=row["prompt"], label=row["label"],
                      metadata=row["metadata"], response_text=response)


def test_rows_are_deterministic_and_scored_by_the_dataset():
    rows = reasoning_gym_rows(dataset="basic_arithmetic", num_samples=6, seed=5)
    assert rows == reasoning_gym_rows(dataset="basic_arithmetic", num_samples=6, seed=5)
    assert rows != reasoning_gym_rows(dataset="basic_arithmetic", num_samples=6, seed=6)
    for row in rows:
        assert row["metadata"]["reasoning_gym"]["dataset"] == "basic_arithmetic"
        right = reasoning_gym_reward(_traj(row, f"<think>hmm</think><answer>{row['label']}</answer>"))
        assert right.score == 1.0 and right.details["correct"] == 1.0
        wrong = reasoning_gym_reward(_traj(row, f"<answer>{row['label']}1</answer>"))
        assert wrong.score < 1.0 and wrong.details["correct"] == 0.0


def test_extract_modes():
    row = reasoning_gym_rows(dataset="chain_sum", num_samples=1, seed=0, config={"min_terms": 2, "max_terms": 2})[0]
    label = row["label"]
    assert reasoning_gym_reward(_traj(row, f"The answer is {label}.")).score == 1.0  # auto -> final answer rules
    assert reasoning_gym_reward(_traj(row, f"The answer is {label}."), extract="tags").details["parsed"] == 0.0
    assert reasoning_gym_reward(_traj(row, f"  {label} "), extract="none").score == 1.0


def test_countdown_dataset_uses_its_own_partial_scores():
    row = reasoning_gym_rows(dataset="countdown", num_samples=1, seed=0)[0]
    good = reasoning_gym_reward(_traj(row, f"<answer>{row['label']}</answer>"))
    bad = reasoning_gym_reward(_traj(row, "<answer>1 + 2</answer>"))
    assert good.score == 1.0 and 0.0 <= bad.score < 1.0


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="did you mean"):
        reasoning_gym_rows(dataset="basic_arithmetc")
    with pytest.raises(ValueError, match="num_samples"):
        reasoning_gym_rows(dataset="chain_sum", config={"size": 3})
    with pytest.raises(ValueError, match="bad config"):
        reasoning_gym_rows(dataset="chain_sum", num_samples=2, config={"no_such_option": 1})
    t = Trajectory(id="t", prompt_id="p", group_id="g", label="3", response_text="3")
    with pytest.raises(ValueError, match="reasoning_gym"):
        reasoning_gym_reward(t)
