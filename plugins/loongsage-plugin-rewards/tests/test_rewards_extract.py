from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loongsage_plugin_rewards.extract import (
    extract_final_answer,
    last_boxed,
    last_number,
    normalize_answer,
    parse_number,
)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so \\boxed{1} then \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),  # last box, nested braces
        ("I think the answer is 42.\nmore text", "42"),
        ("Answer: Paris", "Paris"),
        ("the answer is 3 and the Answer: 7.", "7"),  # the last marker wins
        ("  17  ", "17"),
        ("<think>the answer is 5</think>\n8", "8"),  # reasoning before </think> is ignored
        ("<think>\\boxed{5}</think> Answer: \\boxed{9}", "9"),
        ("\\boxed{unclosed", "\\boxed{unclosed"),
        ("", ""),
    ],
)
def test_extract_final_answer(response, expected):
    assert extract_final_answer(response) == expected


def test_last_boxed_handles_fbox_and_missing():
    assert last_boxed("\\fbox{a{b}c}") == "a{b}c"
    assert last_boxed("no box") is None


# Contents holding "</think>" are excluded: everything before the last one is reasoning, dropped
# by design (see the "<think>" cases above), so such a box cannot round-trip.
@given(st.text(alphabet=st.characters(blacklist_characters="{}\\", blacklist_categories=("Cs",)), max_size=30)
       .filter(lambda text: "</think>" not in text))
def test_boxed_content_round_trips(content):
    assert extract_final_answer(f"work... \\boxed{{{content}}} end") == content.strip()


@pytest.mark.parametrize(
    "raw, expected",
    [("$42$", "42"), ("1,000", "1000"), (" Paris. ", "paris"), ("\\text{yes}", "yes"), ("a   b", "a b")],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_normalize_keeps_case_when_asked():
    assert normalize_answer("Paris", case_sensitive=True) == "Paris"


@pytest.mark.parametrize(
    "text, expected",
    [("x = -4", Fraction(-4)), ("3/4 of it", Fraction(3, 4)), ("it is 1,234.5.", Fraction("1234.5")),
     ("1e3 m", 1000.0), ("a 2 then 7", Fraction(7)), ("none", None)],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_parse_number_rejects_zero_denominator_and_words():
    assert parse_number("1/0") is None
    assert parse_number("seven") is None


@given(st.integers(min_value=-10**12, max_value=10**12))
def test_integers_round_trip(n):
    assert last_number(f"so the result: {n}.") == n
