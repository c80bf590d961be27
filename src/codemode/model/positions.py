"""Error positions in the lines the model wrote.

An exec input may start with a ``// @exec:`` pragma line, which is removed before the cell runs
(the execute request carries the code without it). The engine then counts lines from the code, so
``exec_main.mjs:2:6`` in an error means line 3 of what the model wrote. The model layer knows how
many lines it removed and moves the positions in error texts (and the site of a failed tool call)
back to the model's lines; the items a cell printed are left as they are.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Final

from codemode.protocol.types import LiveCell, Result, RuntimeResponse, WaitOutcome

__all__ = ["in_source_lines", "outcome_in_source_lines"]

# A line of at most 15 digits: longer ones are no engine position but text a cell wrote (and
# int() refuses more than 4,300 digits).
_POSITION: Final = re.compile(r"\bexec_main\.mjs:(\d{1,15}):(\d+)")


def in_source_lines(response: RuntimeResponse, removed_lines: int) -> RuntimeResponse:
    """``response`` with the line numbers of its error text moved down by ``removed_lines``."""
    if not removed_lines or not isinstance(response, Result) or response.error_text is None:
        return response
    text = _POSITION.sub(
        lambda match: f"exec_main.mjs:{int(match[1]) + removed_lines}:{match[2]}",
        response.error_text,
    )
    site = response.failed_call
    if site is not None:
        site = replace(site, line=site.line + removed_lines)
    return replace(response, error_text=text, failed_call=site)


def outcome_in_source_lines(outcome: WaitOutcome, removed_lines: int) -> WaitOutcome:
    """The same for the response a wait or terminate returned."""
    if isinstance(outcome, LiveCell):
        return LiveCell(in_source_lines(outcome.response, removed_lines))
    return outcome  # a missing cell has no position to move
