"""``loongsage_core.safe_json``: bounds measured before parsing, the same values as ``json`` within them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loongsage_core import safe_json

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(), inner, max_size=3), max_leaves=30)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


def count(value: Any) -> int:
    children = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else []
    return len(children) + sum(count(c) for c in children)


@settings(max_examples=300)
@given(value=values, indent=st.sampled_from([None, 1]))
def test_within_bounds_it_parses_as_json_does_and_measures_depth_exactly(value, indent):
    text = json.dumps(value, indent=indent)
    assert safe_json.loads(text) == json.loads(text)
    assert safe_json.loads(text.encode()) == json.loads(text)
    d = depth(value)
    safe_json.check_bounds(text, max_depth=d)
    if d:
        with pytest.raises(safe_json.JsonLimitError, match=f"nests deeper than {d - 1} levels"):
            safe_json.check_bounds(text, max_depth=d - 1)
    assert count(value) < safe_json.DEFAULT_MAX_ITEMS


@pytest.mark.parametrize("text,problem", [
    ("[" * 200_000 + "]" * 200_000, "nests deeper than 64 levels"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nests deeper than 64 levels"),
    ('{"metadata": ' + "[" * 65 + "]" * 65 + "}", "nests deeper than 64 levels"),
    ("[1e999]", "out of range"),
    ("[NaN]", "NaN is not a JSON value"),
    ("[-Infinity]", "-Infinity is not a JSON value"),
])
def test_beyond_bounds_it_is_a_value_error_naming_the_limit(text, problem):
    with pytest.raises(safe_json.JsonLimitError, match=problem):
        safe_json.loads(text)


def test_brackets_inside_strings_do_not_count_and_too_many_values_is_refused():
    text = json.dumps({"a": "[" * 1000 + '\\"{' * 100, "b": ["]]]"]})
    assert safe_json.loads(text) == json.loads(text)
    with pytest.raises(safe_json.JsonLimitError, match="more than 10 values"):
        safe_json.loads(json.dumps(list(range(11))), max_items=10)
    assert safe_json.loads(json.dumps(list(range(10))), max_items=10) == list(range(10))
    with pytest.raises(ValueError):  # invalid JSON is the parser's own error
        safe_json.loads("[1, 2")
