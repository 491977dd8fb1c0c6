import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loongsage_plugin_rewards.countdown_reward import countdown_reward, parse_expression
from loongsage_plugin_rewards.rewards import exact_match, numeric_match
from loongsage_plugin_rewards.sources.arithmetic import arithmetic_rows, evaluate
from loongsage_plugin_rewards.sources.countdown import countdown_rows

from loongsage_hookspecs import Trajectory


def _traj(row, response):
    return Trajectory(id="t", prompt_id="p", group_id="g", prompt=row["prompt"], label=row["label"],
                      metadata=row["metadata"], response_text=response)


def test_arithmetic_rows_are_deterministic_and_seeded():
    a = arithmetic_rows(num_samples=50, seed=3, digits=2, num_operands=3)
    assert a == arithmetic_rows(num_samples=50, seed=3, digits=2, num_operands=3)
    assert a != arithmetic_rows(num_samples=50, seed=4, digits=2, num_operands=3)
    assert len(a) == 50 and set(a[0]) == {"prompt", "label", "metadata"}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), digits=st.integers(1, 3), n=st.integers(2, 4),
       ops=st.sampled_from(["+", "-", "+-", "+-*"]))
def test_arithmetic_labels_are_the_values_of_the_expressions(seed, digits, n, ops):
    for row in arithmetic_rows(num_samples=5, seed=seed, digits=digits, num_operands=n, ops=ops):
        meta = row["metadata"]
        expression = re.fullmatch(r"What is (.*)\?", row["prompt"]).group(1)
        assert expression == meta["expression"]
        assert int(row["label"]) == eval(expression) == meta["answer"]  # noqa: S307 - digits and + - * only
        assert len(meta["operands"]) == n and all(0 <= x < 10**digits for x in meta["operands"])
        assert set(meta["operators"]) <= set(ops)


def test_arithmetic_options_and_rewards():
    rows = arithmetic_rows(num_samples=200, seed=0, ops="-", allow_negative=False, template="Compute {expression}.")
    assert all(r["metadata"]["answer"] >= 0 and r["prompt"].startswith("Compute ") for r in rows)
    row = rows[0]
    assert exact_match(_traj(row, row["label"])).score == 1.0
    assert numeric_match(_traj(row, f"The answer is {row['label']}.")).score == 1.0
    assert exact_match(_traj(row, str(int(row["label"]) + 1))).score == 0.0


def test_evaluate_uses_precedence():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([9, 2, 3], ["-", "-"]) == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [({"digits": 0}, "digits"), ({"num_operands": 1}, "num_operands"), ({"ops": "/"}, "ops"),
     ({"template": "no slot"}, "template"), ({"num_samples": "10"}, "num_samples"),
     ({"ops": "-", "num_operands": 16, "allow_negative": False, "num_samples": 2}, "negative")],
)
def test_arithmetic_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        arithmetic_rows(**kwargs)


def test_countdown_rows_are_deterministic_and_solvable():
    rows = countdown_rows(num_samples=40, seed=1)
    assert rows == countdown_rows(num_samples=40, seed=1)
    for row in rows:
        meta = row["metadata"]
        assert 1 <= row["label"] <= 100 and len(meta["numbers"]) == 4
        assert str(row["label"]) in row["prompt"] and "\\boxed{}" in row["prompt"]
        r = countdown_reward(_traj(row, f"\\boxed{{{meta['solution']}}}"))
        assert r.score == 1.0, (row, r)


def test_countdown_use_all_builds_from_every_number():
    for row in countdown_rows(num_samples=20, seed=2, num_numbers=3, use_all=True):
        assert countdown_reward(_traj(row, row["metadata"]["solution"]), use_all=True).score == 1.0


def test_countdown_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_numbers"):
        countdown_rows(num_numbers=1)
    with pytest.raises(ValueError, match="widen"):
        countdown_rows(num_samples=1, min_value=1, max_value=1, num_numbers=2, min_target=500, max_target=600)


META = {"numbers": [3, 7, 25, 2], "target": 39}


@pytest.mark.parametrize(
    "response, kwargs, score, details",
    [
        ("\\boxed{25 + 7 * 2}", {}, 1.0, {"correct": 1.0, "parsed": 1.0, "valid_numbers": 1.0}),
        ("The answer is (25 - 3) * 2 - 3 - 2 = 39", {}, 0.0, {"correct": 0.0, "parsed": 1.0, "valid_numbers": 0.0}),
        ("\\boxed{25 + 7 * 2}", {"use_all": True}, 0.0, {"correct": 0.0, "parsed": 1.0, "valid_numbers": 0.0}),
        ("\\boxed{25 + 7 * 3 + 2 - 7}", {}, 0.0, {"correct": 0.0, "parsed": 1.0, "valid_numbers": 0.0}),
        ("\\boxed{25 + 7}", {"format_score": 0.1}, 0.1, {"correct": 0.0, "parsed": 1.0, "valid_numbers": 1.0}),
        ("\\boxed{__import__('os')}", {}, 0.0, {"correct": 0.0, "parsed": 0.0, "valid_numbers": 0.0}),
        ("\\boxed{7 / (3 - 3)}", {}, 0.0, {"correct": 0.0, "parsed": 0.0, "valid_numbers": 0.0}),
        ("\\boxed{(7 \\times 2 + 25)}", {}, 1.0, {"correct": 1.0, "parsed": 1.0, "valid_numbers": 1.0}),
    ],
)
def test_countdown_reward(response, kwargs, score, details):
    t = Trajectory(id="t", prompt_id="p", group_id="g", label=39, metadata=META, response_text=response)
    r = countdown_reward(t, **kwargs)
    assert (r.score, r.details) == (score, details)


def test_countdown_reward_needs_numbers():
    t = Trajectory(id="t", prompt_id="p", group_id="g", label=41, response_text="1")
    with pytest.raises(ValueError, match="numbers"):
        countdown_reward(t)


def test_parse_expression_divides_exactly():
    value, used = parse_expression("7 / 2 * 2")
    assert value == 7 and used == [7, 2, 2]
    assert parse_expression("2 ** 3") is None and parse_expression("1.5 + 1") is None
