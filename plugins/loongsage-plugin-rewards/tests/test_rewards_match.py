import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loongsage_plugin_rewards.math_reward import math_verify_reward, simple_equivalent
from loongsage_plugin_rewards.rewards import exact_match, format_reward, numeric_match

from loongsage_hookspecs import Reward, Trajectory


def test_exact_match_scores_and_details(traj):
    r = exact_match(traj("The answer is 12.", "12"))
    assert isinstance(r, Reward) and r.score == 1.0 and r.details == {"correct": 1.0, "parsed": 1.0}
    r = exact_match(traj("The answer is 13.", "12"))
    assert r.score == 0.0 and r.details == {"correct": 0.0, "parsed": 1.0}
    assert exact_match(traj("   ", "12")).details["parsed"] == 0.0


def test_exact_match_options(traj):
    assert exact_match(traj("PARIS", "paris")).score == 1.0
    assert exact_match(traj("PARIS", "paris"), case_sensitive=True).score == 0.0
    assert exact_match(traj("\\boxed{7}", "7"), extract=False).score == 0.0
    assert exact_match(traj("7", "7"), score=2.5).score == 2.5
    assert exact_match(traj("b", ["a", "b"])).score == 1.0  # a list label means any of them
    assert exact_match(traj("-4", -4)).score == 1.0  # non-string labels compare by their text


def test_exact_match_without_label_is_an_error(traj):
    with pytest.raises(ValueError, match="no label"):
        exact_match(traj("7", None))


def test_numeric_match(traj):
    assert numeric_match(traj("so x = 3.0000001", "3"), tolerance=1e-3).score == 1.0
    assert numeric_match(traj("so x = 3.01", "3"), tolerance=1e-3).score == 0.0
    assert numeric_match(traj("about 105", 100), rel_tolerance=0.1).score == 1.0
    assert numeric_match(traj("\\boxed{3/4}", "0.75")).score == 1.0
    r = numeric_match(traj("no digits here", "5"))
    assert r.score == 0.0 and r.details == {"correct": 0.0, "parsed": 0.0}
    # the number of the final answer wins over numbers elsewhere in the response
    assert numeric_match(traj("12 + 30 gives 40? no. The answer is 42", "42")).score == 1.0


def test_numeric_match_errors(traj):
    with pytest.raises(ValueError, match="no number"):
        numeric_match(traj("5", "five"))
    with pytest.raises(ValueError, match="tolerance"):
        numeric_match(traj("5", "5"), tolerance=-1)


@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
def test_numeric_match_is_exact_on_integers(a, b):
    t = Trajectory(id="t", prompt_id="p", group_id="g", response_text=f"The answer is {a}", label=str(b))
    assert numeric_match(t).score == float(a == b)


def test_format_reward(traj):
    pat = r"<answer>.*</answer>"
    assert format_reward(traj("x <answer>\n5\n</answer>"), pattern=pat).score == 1.0
    assert format_reward(traj("x <answer>5"), pattern=pat).score == 0.0
    assert format_reward(traj("x <answer>5</answer>"), pattern=pat, mode="match").score == 0.0
    assert format_reward(traj(" <ANSWER>5</ANSWER> "), pattern=pat, mode="fullmatch", ignore_case=True).score == 1.0
    assert format_reward(traj("abc"), pattern="b").details == {"matched": 1.0}


def test_format_reward_errors(traj):
    with pytest.raises(ValueError, match="invalid regex"):
        format_reward(traj("x"), pattern="(")
    with pytest.raises(ValueError, match="mode"):
        format_reward(traj("x"), pattern="x", mode="find")


@pytest.mark.parametrize("backend", ["math_verify", "simple"])
@pytest.mark.parametrize(
    "response, label, correct",
    [("The answer is \\boxed{\\frac{1}{2}}", "0.5", True), ("\\boxed{0.5}", "\\frac{1}{2}", True),
     ("\\boxed{3}", "4", False), ("so $x = 10$, the answer is \\boxed{10}", "10", True)],
)
def test_math_verify_backends(traj, backend, response, label, correct):
    r = math_verify_reward(traj(response, label), backend=backend)
    assert r.score == float(correct) and r.details["correct"] == float(correct)


def test_math_verify_symbolic_equivalence_needs_the_package(traj):
    assert math_verify_reward(traj("\\boxed{1 + x}", "x+1"), backend="math_verify").score == 1.0


def test_math_verify_runs_off_the_main_thread(traj):
    out = []
    thread = threading.Thread(target=lambda: out.append(math_verify_reward(traj("\\boxed{2}", "2"))))
    thread.start()
    thread.join(30)
    assert out and out[0].score == 1.0


def test_math_verify_errors(traj):
    with pytest.raises(ValueError, match="backend"):
        math_verify_reward(traj("1", "1"), backend="sympy")
    with pytest.raises(ValueError, match="no label"):
        math_verify_reward(traj("1", None))


def test_simple_equivalent_rules():
    assert simple_equivalent("\\dfrac{3}{4}", "0.75")
    assert simple_equivalent("90^\\circ", "90")
    assert simple_equivalent("\\left( 1, 2 \\right)", "(1,2)")
    assert not simple_equivalent("0.7", "0.75")
