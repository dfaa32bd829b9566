"""The strict JSON decoder (:mod:`akv_transport._json`): each rule it refuses text by, what it
leaves to its callers, and properties over generated texts. Plain calls, no I/O."""

from __future__ import annotations

import ast
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import akv_transport as transport
from akv_transport import DEFAULT_JSON_MAX_DEPTH, JSONError, TransportError, parse_json
from akv_transport._json import JSON_MAX_INT, JSON_MIN_INT, nesting

# ---------------------------------------------------------------------- one rule each


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_the_infinities_are_refused_by_name(text):
    with pytest.raises(JSONError, match=f"{text} is not a number"):
        parse_json(f'{{"lr": {text}}}')


@pytest.mark.parametrize("text", ["1e999", "-1e999", "1.5e309", "[1e400]"])
def test_a_number_that_overflows_a_float_is_refused(text):
    with pytest.raises(JSONError, match="out of range"):
        parse_json(text)


@pytest.mark.parametrize(
    "digits",
    [str(JSON_MAX_INT + 1), str(JSON_MIN_INT - 1), "1" + "0" * 20, "-1" + "0" * 20, "9" * 5000],
    ids=["uint64-max+1", "int64-min-1", "1e20", "-1e20", "5000-digits"],
)
def test_an_integer_beyond_64_bits_is_refused(digits):
    with pytest.raises(JSONError, match="does not fit in 64 bits"):
        parse_json(f"[{digits}]")


def test_nesting_deeper_than_the_bound_is_refused_with_both_depths():
    deeper = DEFAULT_JSON_MAX_DEPTH + 1
    text = "[" * deeper + "]" * deeper
    with pytest.raises(JSONError, match=f"nested {deeper} levels deep; at most {deeper - 1} "):
        parse_json(text)
    assert parse_json(text, max_depth=deeper) == json.loads(text)


def test_objects_and_arrays_count_alike_towards_the_depth():
    text = '{"a": [{"b": [1]}]}'
    assert nesting(text) == 4
    assert parse_json(text, max_depth=4) == {"a": [{"b": [1]}]}
    with pytest.raises(JSONError):
        parse_json(text, max_depth=3)


def test_hostile_nesting_costs_one_linear_scan_and_no_recursion():
    text = "[" * 1_000_000  # never closed: refused by the scan, before the decoder sees it
    started = time.perf_counter()
    with pytest.raises(JSONError, match="1000000 levels deep"):
        parse_json(text)
    assert time.perf_counter() - started < 5.0


@pytest.mark.parametrize("data", [b"\xff", b'{"a": "\xff"}', b"\xed\xa0\x80", b"\xc3"])
def test_bytes_that_are_not_utf8_are_refused(data):
    with pytest.raises(JSONError, match="must be UTF-8"):
        parse_json(data)


@pytest.mark.parametrize("text", ["", "{", '{"a": 1} x', "[1,]", "{'a': 1}", "\ufeff{}"])
def test_malformed_text_is_refused(text):
    with pytest.raises(JSONError, match="not valid JSON"):
        parse_json(text)


def test_a_refusal_is_a_json_error_a_transport_error_and_a_value_error():
    with pytest.raises(JSONError) as caught:
        parse_json("NaN")
    assert isinstance(caught.value, TransportError)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("kind", [str, bytes, bytearray, memoryview])
def test_text_and_every_kind_of_bytes_decode_alike(kind):
    text = '{"port": 9000, "hosts": ["a", "b"], "lr": 0.5}'
    data: Any = text if kind is str else kind(text.encode())
    assert parse_json(data) == {"port": 9000, "hosts": ["a", "b"], "lr": 0.5}


# ---------------------------------------------------------------------- left to callers


def test_duplicate_keys_are_not_refused_and_the_last_one_wins():
    assert parse_json('{"rank": 0, "rank": 1}') == {"rank": 1}


@pytest.mark.parametrize("text", ["[]", '"w0"', "42", "null", "true"])
def test_any_value_is_accepted_at_the_top_level(text):
    assert parse_json(text) == json.loads(text)


def test_length_is_not_bounded_by_the_decoder():
    big = "[" + ",".join(["1"] * 100_000) + "]"  # the server bounds bodies (413) before
    assert len(parse_json(big)) == 100_000


def test_the_strict_decoder_is_public_and_does_no_io():
    assert transport.parse_json is parse_json and "parse_json" in transport.__all__
    path = Path(transport.__file__).with_name("_json.py")
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert imported <= {
        "__future__",
        "itertools",
        "json",
        "math",
        "re",
        "typing",
        "akv_transport.errors",
    }


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
