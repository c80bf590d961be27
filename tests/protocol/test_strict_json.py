"""Strict JSON (§2.1): every rejection, and the duplicate-key check on each of its paths."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codemode.protocol.strict_json import LARGE_PAYLOAD_BYTES, JSONError, dumps, loads

REJECTED = [
    b"",
    b"\xef\xbb\xbf{}",
    b'"\xff"',
    b"{} []",
    b"NaN",
    b"[Infinity]",
    b"-Infinity",
    b"1e400",
    b'"\\ud800"',
    b'{"a":1,"a":2}',
    b'{"a":{"b":1,"b":1}}',
    b'[{"x":"1:2","x":"3"}]',
    b'{"a\\u003a":1,"a\\u003a":2}',
    b'{"\\u0061":1,"a":2}',
    b"{'a':1}",
]


@pytest.mark.parametrize("text", REJECTED)
def test_rejected(text: bytes) -> None:
    with pytest.raises(JSONError):
        loads(text)


@pytest.mark.parametrize("text", REJECTED[1:])
def test_rejected_when_large(text: bytes) -> None:
    padded = b'{"pad":"' + b"x" * LARGE_PAYLOAD_BYTES + b'","v":' + text + b"}"
    with pytest.raises(JSONError):
        loads(padded)


@pytest.mark.parametrize(
    ("text", "byte"),
    [(b'"\\ud800"', 1), (b'["\\ud800"]', 2), (b'{"a":"x\\uDBFF"}', 7), (b'"\\\\\\ud800"', 3)],
)
def test_an_unpaired_surrogate_escape_is_named_not_called_truncated(text: bytes, byte: int) -> None:
    # msgspec reports these as "Input data was truncated"; the text is whole.
    with pytest.raises(JSONError) as raised:
        loads(text)
    assert str(raised.value) == f"JSON is malformed: unpaired utf-16 surrogate escape (byte {byte})"


@pytest.mark.parametrize("text", [b'"abc', b'["\\\\ud800', b'{"a":'])
def test_a_truncated_text_is_still_called_truncated(text: bytes) -> None:
    with pytest.raises(JSONError, match=r"^Input data was truncated$"):
        loads(text)


def test_lone_surrogate_character_in_str_is_rejected() -> None:
    with pytest.raises(JSONError):
        loads('"\ud800"')


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (b' {"a" : "x:y" , "b":[1,2.5,null,true]} ', {"a": "x:y", "b": [1, 2.5, None, True]}),
        (b'{"a\\u003a":1,"a:":2}', None),
        (b'"\\u003a"', ":"),
        (b"18446744073709551616", 2**64),
    ],
)
def test_accepted(text: bytes, value: Any) -> None:
    if value is None:
        with pytest.raises(JSONError):
            loads(text)  # the escaped and raw spellings name the same key
    else:
        assert loads(text) == value


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=20,
)


@given(json_values)
def test_round_trip(value: Any) -> None:
    assert loads(dumps(value)) == value


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ({"a": [1, 2.5, None, "x"]}, None),
        ({"a": [1, float("inf")]}, float("inf")),
        ((1, {"b": float("-inf")}), float("-inf")),
    ],
)
def test_non_finite_number(value: Any, found: float | None) -> None:
    from codemode.protocol.strict_json import non_finite_number

    assert non_finite_number(value) == found
    assert non_finite_number([float("nan")]) != non_finite_number([float("nan")])  # NaN is found


def _walk_for_non_finite(value: Any) -> bool:
    """The plain definition: is any float inside ``value`` a NaN or an infinity?"""
    if type(value) is float:
        return value != value or value in (float("inf"), float("-inf"))
    if isinstance(value, dict):
        return any(_walk_for_non_finite(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_walk_for_non_finite(item) for item in value)
    return False


any_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=40,
)


@given(any_values)
def test_non_finite_number_finds_exactly_the_nan_and_infinities(value: Any) -> None:
    # Guards the fast screen (a search over the value packed as MessagePack): no non-finite
    # float is missed, and a false alarm never reports one that is not there.
    from codemode.protocol.strict_json import non_finite_number

    found = non_finite_number(value)
    assert (found is not None) == _walk_for_non_finite(value)
    if found is not None:
        assert found != found or found in (float("inf"), float("-inf"))


#: Values whose packed bytes hold 0xcb then a non-finite float's first two bytes, without one.
FALSE_ALARMS = [
    "\x7f\U0001f600" + "x" * 198,  # 203 bytes of UTF-8: its length byte is 0xcb
    [0xCB7FF000],  # an integer's bytes
]


@pytest.mark.parametrize("value", FALSE_ALARMS)
def test_a_false_alarm_of_the_screen_reports_no_number(value: Any) -> None:
    from codemode.protocol import strict_json

    packed = strict_json._MSGPACK.encode(value)
    assert strict_json._NON_FINITE_FLOAT64.search(packed) is not None  # the screen fires
    assert strict_json.non_finite_number(value) is None  # and the walk clears it


def test_a_number_out_of_range_among_many_values_is_rejected() -> None:
    # Guards: the check for numbers jiter read as infinite covers every value of a large text
    # (it runs on a packed copy, at C speed, where a Python walk took 0.5 s per 4 M numbers).
    text = b"[" + b'[0,{"a":[1.5]}],' * 100_000 + b'{"deep":[[[1e999]]]}]'
    with pytest.raises(JSONError, match="number out of range"):
        loads(text)
    assert len(loads(text.replace(b"1e999", b"1e300"))) == 100_001


@pytest.mark.parametrize("collecting", [True, False])
@pytest.mark.parametrize(
    "text", [b"[" + b"[]," * 100_000 + b"[]]", b"[" + b"[]," * 100_000 + b"1e999]"]
)
def test_a_large_text_leaves_the_collector_as_it_found_it(collecting: bool, text: bytes) -> None:
    # Guards: a large text is decoded with the cyclic collector paused (it walked the decode's
    # millions of new lists again and again); it is given back as it was, refused text or not.
    (gc.enable if collecting else gc.disable)()
    try:
        with contextlib.suppress(JSONError):
            loads(text)
        assert gc.isenabled() is collecting
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "text",
    [
        b'{"a\\u003ab":1,"a\\u003Ab":2}',
        b'{"\\\\u003a":1,"\\\\u003a":2}',  # an escaped backslash, then plain text: no colon
        b'{"x":"\\u003a\\u003a","x":1}',
    ],
)
def test_escaped_colons_do_not_hide_a_duplicate(text: bytes) -> None:
    with pytest.raises(JSONError, match="duplicate"):
        loads(text)
    padded = b'{"pad":"' + b"x" * LARGE_PAYLOAD_BYTES + b'","v":' + text + b"}"
    with pytest.raises(JSONError):
        loads(padded)


def test_escaped_colons_without_a_duplicate_are_accepted() -> None:
    assert loads(b'{"a\\u003a":"\\u003A:","\\\\u003a":1}') == {"a:": "::", "\\u003a": 1}
