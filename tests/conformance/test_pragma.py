"""``pragma.json``: ``parse_exec_source`` results and exact error messages."""

from __future__ import annotations

from typing import Any

import pytest

from codemode.errors import CodeModeError
from codemode.protocol import parse_exec_source
from tests.conformance.vectors import params


@pytest.mark.parametrize("entry", params("pragma.json"))
def test_pragma(entry: dict[str, Any]) -> None:
    if "expect" in entry:
        parsed = parse_exec_source(entry["input"])
        assert {
            "code": parsed.code,
            "yield_time_ms": parsed.yield_time_ms,
            "max_output_tokens": parsed.max_output_tokens,
        } == entry["expect"]
        return
    with pytest.raises(CodeModeError) as caught:
        parse_exec_source(entry["input"])
    if "error" in entry:
        assert str(caught.value) == entry["error"]
    else:
        assert str(caught.value).startswith(entry["error_prefix"])
        assert len(str(caught.value)) > len(entry["error_prefix"])
