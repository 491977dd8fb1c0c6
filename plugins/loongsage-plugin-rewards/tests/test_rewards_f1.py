"""``token_f1``: SQuAD's token-overlap F1 of the final answer against the label(s)."""

import pytest
from loongsage_plugin_rewards.rewards import answer_tokens, f1_score, token_f1


def test_answer_tokens_drop_case_punctuation_and_articles():
    assert answer_tokens("The Kazal Motors, Inc.") == ["kazal", "motors", "inc"]
    assert answer_tokens("  a  ") == []


def test_f1_counts_shared_words():
    assert f1_score("Kazal Motors", "Kazal Motors") == 1.0
    assert f1_score("Kazal", "Kazal Motors") == pytest.approx(2 * 1.0 * 0.5 / 1.5)  # P 1, R 1/2
    assert f1_score("Kazal Works", "Kazal Motors") == pytest.approx(0.5)  # P 1/2, R 1/2
    assert f1_score("Penolford", "Bipumburg") == 0.0
    assert f1_score("a a b", "a b b") == pytest.approx(1.0 - 1 / 3)  # "a" once shared, "b" once: 2 of 3 each
    assert f1_score("", "") == 1.0 and f1_score("x", "") == 0.0


def test_token_f1_reward(traj):
    r = token_f1(traj("Answer: the Kazal Motors.", "Kazal Motors"))
    assert r.score == 1.0 and r.details == {"f1": 1.0, "exact": 1.0, "parsed": 1.0}
    r = token_f1(traj("Kazal", "Kazal Motors"), score=3.0)
    assert r.score == pytest.approx(2.0) and r.details["exact"] == 0.0 and "0.67" in r.reason
    assert token_f1(traj("Vesford", ["Bipumburg", "Vesford"])).score == 1.0  # any label
    assert token_f1(traj("\\boxed{1702}", "1702")).score == 1.0
    # unextracted, "boxed" is one more word: P 1/2, R 1
    assert token_f1(traj("\\boxed{1702}", "1702"), extract=False).score == pytest.approx(2 / 3)
    r = token_f1(traj("   ", "1702"))
    assert r.score == 0.0 and r.details["parsed"] == 0.0 and r.reason == "no answer found in the response"
    with pytest.raises(ValueError, match="no label"):
        token_f1(traj("x", None))
