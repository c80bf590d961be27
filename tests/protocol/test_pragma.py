"""``parse_exec_source`` beyond the conformance vectors (``tests/conformance/test_pragma.py``)."""

from __future__ import annotations

import pytest

from codemode.errors import CodeModeError
from codemode.protocol import parse_exec_source


@pytest.mark.parametrize("opening", ["[", '{"a":'])
def test_a_pragma_nested_past_the_decoder_is_invalid_pragma_json(opening: str) -> None:
    # The decoder raises RecursionError past its depth: the P4 text, not a crash of the caller.
    with pytest.raises(CodeModeError) as caught:
        parse_exec_source("// @exec: " + opening * 5000 + "\ntext(1)")
    assert str(caught.value) == (
        "exec pragma must be valid JSON with supported fields `yield_time_ms` and "
        "`max_output_tokens`: recursion limit exceeded"
    )
