"""The strict JSON decoder (:mod:`transport._json`): hostile texts, and properties over
generated texts. Plain calls, no I/O."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport import JSONError, parse_json
from transport._json import nesting

# ---------------------------------------------------------------------- hostile texts


def depth_of(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    return 0


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000 + "]" * 5000,
        '{"a": ' * 5000 + "1" + "}" * 5000,
        "[" * 200000,  # not even closed
        "NaN",
        "[Infinity]",
        '{"x": -Infinity}',
        "1e999",
        "[-1e999]",
        '{"port": 1e400}',
        str(1 << 64),
        str(-(1 << 63) - 1),
        "9" * 5000,
        "[1, 2",
        "",
        "\ufeff{}",
        '{"a": 1} x',
    ],
)
def test_parse_json_refuses_hostile_text(text):
    with pytest.raises(JSONError):
        parse_json(text)
    with pytest.raises(ValueError):  # a JSONError is a ValueError too
        parse_json(text.encode())


def test_parse_json_accepts_the_edges_of_what_it_allows():
    assert parse_json(str((1 << 64) - 1)) == (1 << 64) - 1
    assert parse_json(str(-(1 << 63))) == -(1 << 63)
    assert parse_json("1.7976931348623157e308") == 1.7976931348623157e308
    assert parse_json("[" * 32 + "]" * 32, max_depth=32) == json.loads("[" * 32 + "]" * 32)
    with pytest.raises(JSONError, match="33"):
        parse_json("[" * 33 + "]" * 33, max_depth=32)
    # Brackets, quotes and backslashes inside strings do not nest.
    text = json.dumps({"a": '[[[{{{"\\\\"]]]', "b": ["\\", '"[', "]"]})
    assert parse_json(text, max_depth=2) == json.loads(text)
    with pytest.raises(JSONError):
        parse_json(b'{"a": "\xff"}')


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab[]{}"\\\n:,é\u2028')),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(alphabet=st.sampled_from('k[]{}"\\'), max_size=4), children)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values, pretty=st.booleans())
def test_parse_json_round_trips_and_measures_depth_exactly(value, pretty):
    text = json.dumps(value, indent=1 if pretty else None, ensure_ascii=pretty)
    depth = depth_of(value)
    assert parse_json(text, max_depth=depth) == value
    assert nesting(text) == depth
    if depth > 0:
        with pytest.raises(JSONError):
            parse_json(text, max_depth=depth - 1)


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=200)
    | st.text(alphabet=st.sampled_from('[]{}"\\:,1eE.-+ atnul')).map(str.encode)
)
def test_parse_json_raises_nothing_but_json_error(data):
    with contextlib.suppress(JSONError):
        parse_json(data, max_depth=8)
