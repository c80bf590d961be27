"""The nesting bound a frame is read under (upstream's reader refuses the 128th level)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codemode.errors import FrameError
from codemode.protocol.strict_json import LARGE_PAYLOAD_BYTES
from codemode.protocol.v1.codec import UPSTREAM_MAX_NESTING, MessageDecoder, _nesting_exceeds
from codemode.protocol.v1.messages import ClientToHost

# Strings full of brackets, quotes and escapes, which must never count as nesting.
tricky_text = st.text(alphabet='[]{}"\\:,ab', max_size=6)
json_values = st.recursive(
    st.none() | st.integers() | tricky_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
    max_leaves=40,
)


def depth(value: Any) -> int:
    """Levels of arrays and objects in ``value``, walked the slow, obvious way."""
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


def nest(value: Any, levels: int) -> Any:
    for level in range(levels):
        value = [value, []] if level % 2 else {"k[": value, "x": [{}]}
    return value


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(min_value=0, max_value=40), st.integers(min_value=1, max_value=50))
def test_nesting_matches_a_walk_of_the_value(value: Any, extra: int, limit: int) -> None:
    value = nest(value, extra)
    text = json.dumps(value).encode()
    assert _nesting_exceeds(text, limit) == (depth(value) > limit)


@pytest.mark.parametrize("shape", ["chain", "wide", "comb"])
@pytest.mark.parametrize("levels", [UPSTREAM_MAX_NESTING, UPSTREAM_MAX_NESTING + 1])
def test_a_large_frame_is_refused_past_upstreams_level(shape: str, levels: int) -> None:
    # The result sits 3 levels down (`{"result":{"value":{"result": ...}}}`); a list of many
    # values adds one more.
    chain = levels - 3 if shape == "chain" else levels - 4
    nested = "[" * chain + "]" * chain
    many = LARGE_PAYLOAD_BYTES // len(nested) + 1
    body = {
        "chain": nested,
        "wide": "[" + ",".join(['[[1],{"a":"]"}]'] * 40_000 + [nested]) + "]",
        "comb": "[" + ",".join([nested] * many) + "]",
    }[shape]
    payload = (
        '{"type":"delegate/response","id":6,"result":{"status":"ok","value":'
        '{"type":"tool/result","result":' + body + "}}}"
    ).encode()
    assert depth(json.loads(payload)) == levels
    decoder = MessageDecoder[Any](ClientToHost, max_depth=UPSTREAM_MAX_NESTING)
    if levels > UPSTREAM_MAX_NESTING:
        with pytest.raises(FrameError, match="recursion limit exceeded"):
            decoder.decode(payload)
    else:
        decoder.decode(payload)


def test_a_large_frame_repeating_a_key_is_refused() -> None:
    payload = (
        '{"type":"delegate/response","id":6,"id":6,"result":{"status":"ok","value":'
        '{"type":"tool/result","result":"' + "x" * LARGE_PAYLOAD_BYTES + '"}}}'
    ).encode()
    with pytest.raises(FrameError, match="duplicate"):
        MessageDecoder[Any](ClientToHost).decode(payload)
