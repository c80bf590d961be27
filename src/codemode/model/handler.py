"""Serving the model's ``exec`` and ``wait`` calls against a session (``runtime.md`` §15.1-§15.4).

The handler turns one model tool call into one :class:`~codemode.model.render.RenderedOutput`:
pragma and argument errors and transport failures come back as their text verbatim (no header,
failure); outcomes are rendered with header and truncation. It also remembers which of the cells
it started are still running, so an owner can terminate them when it stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

from codemode.errors import CodeModeError
from codemode.model.exec_tool import parse_wait_arguments
from codemode.model.positions import in_source_lines, outcome_in_source_lines
from codemode.model.registry import current_exec_call_id
from codemode.model.render import RenderedOutput, render_outcome, render_response
from codemode.model.tracing import CellSpan, CellSpans, outcome_of
from codemode.protocol.pragma import parse_exec_source
from codemode.protocol.surrogates import well_formed
from codemode.protocol.types import (
    CellId,
    ExecuteRequest,
    InputText,
    MissingCell,
    RuntimeResponse,
    ToolDefinition,
    WaitOutcome,
    WaitRequest,
    Yielded,
)
from codemode.session import CodeModeSession

__all__ = [
    "EXEC_EXPECTS_FREEFORM",
    "WAIT_EXPECTS_JSON",
    "CodeModeToolHandler",
    "CustomToolInput",
    "FunctionToolArguments",
    "ToolPayload",
]

EXEC_EXPECTS_FREEFORM: Final = "exec expects raw JavaScript source text"
WAIT_EXPECTS_JSON: Final = "wait expects JSON arguments"


@dataclass(frozen=True, slots=True)
class CustomToolInput:
    """The raw text input of a custom (freeform) tool call."""

    input: str


@dataclass(frozen=True, slots=True)
class FunctionToolArguments:
    """The JSON argument text of a function tool call."""

    arguments: str


ToolPayload: TypeAlias = CustomToolInput | FunctionToolArguments


def _failure(message: str) -> RenderedOutput:
    return RenderedOutput([InputText(message)], success=False)


class CodeModeToolHandler:
    """Runs ``exec``/``wait`` calls on one session with a fixed or computed set of nested tools."""

    def __init__(
        self,
        session: CodeModeSession,
        enabled_tools: Sequence[ToolDefinition] | Callable[[], Sequence[ToolDefinition]] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        cell_spans: CellSpans | None = None,
    ) -> None:
        self._session = session
        self._spans = cell_spans or CellSpans()
        # The open spans of this handler's cells (cell ids are unique within its session only).
        self._cell_spans: dict[CellId, CellSpan] = {}
        self._enabled_tools = enabled_tools
        self._clock = clock
        # Cells started here that yielded and have not ended -> the exec call id that started them.
        self._live: dict[CellId, str] = {}
        # Live cells whose input began with a pragma line -> the lines removed (for error lines).
        self._removed: dict[CellId, int] = {}

    @property
    def session(self) -> CodeModeSession:
        """The session the calls run on."""
        return self._session

    @property
    def live_cells(self) -> Mapping[CellId, str]:
        """Cells this handler started that are still running, with their exec call ids."""
        return dict(self._live)

    def _track_initial(self, call_id: str, response: RuntimeResponse, removed: int) -> None:
        if isinstance(response, Yielded):
            self._live[response.cell_id] = call_id
            if removed:
                self._removed[response.cell_id] = removed

    def _track_outcome(self, cell_id: CellId, outcome: WaitOutcome) -> None:
        # Only a yield keeps a cell alive; a missing cell is gone whatever we thought.
        if isinstance(outcome, MissingCell) or not isinstance(outcome.response, Yielded):
            self._live.pop(cell_id, None)
            self._removed.pop(cell_id, None)

    def finish_span(self, cell_id: CellId, outcome: str) -> None:
        """End the span of this handler's cell ``cell_id`` (if tracing, and open) with
        ``outcome``."""
        span = self._cell_spans.pop(cell_id, None)
        if span is not None:
            span.finish(outcome)

    def _fail_span(self, span: CellSpan | None, message: str, cell_id: CellId | None) -> None:
        if cell_id is not None:
            self._cell_spans.pop(cell_id, None)
        if span is not None:
            span.fail(message)

    def _tools(self) -> list[ToolDefinition]:
        tools = self._enabled_tools
        return list(tools() if callable(tools) else tools)

    async def handle_exec(self, call_id: str, payload: ToolPayload | str) -> RenderedOutput:
        """Parse the pragma, execute, and render the initial response."""
        started = self._clock()
        if isinstance(payload, FunctionToolArguments):
            return _failure(EXEC_EXPECTS_FREEFORM)
        source = well_formed(payload.input if isinstance(payload, CustomToolInput) else payload)
        span = self._spans.start_cell(call_id)
        cell_id: CellId | None = None
        try:
            parsed = parse_exec_source(source)
            request = ExecuteRequest(
                tool_call_id=call_id,
                source=parsed.code,
                enabled_tools=self._tools(),
                yield_time_ms=parsed.yield_time_ms,
                max_output_tokens=parsed.max_output_tokens,
            )
            # The cell's callbacks run in a copy of this context: its tools see this call id.
            token = current_exec_call_id.set(call_id)
            try:
                with self._spans.executing(span):
                    cell = await self._session.execute(request)
            finally:
                current_exec_call_id.reset(token)
            cell_id = cell.cell_id
            if span is not None:
                span.bind(cell_id)
                self._cell_spans[cell_id] = span
            response = await cell.initial_response()
        except CodeModeError as error:
            self._fail_span(span, error.message, cell_id)
            return _failure(error.message)
        except BaseException:
            self._fail_span(span, "cancelled", cell_id)
            raise
        if not isinstance(response, Yielded):
            self.finish_span(response.cell_id, outcome_of(response))
        self._track_initial(call_id, response, parsed.removed_lines)
        response = in_source_lines(response, parsed.removed_lines)
        return render_response(response, self._clock() - started, parsed.max_output_tokens)

    async def handle_wait(
        self, payload: ToolPayload | str | Mapping[str, object]
    ) -> RenderedOutput:
        """Decode the arguments (JSON text, a payload, or a mapping already decoded), then wait on
        or terminate the cell and render the outcome."""
        started = self._clock()
        if isinstance(payload, CustomToolInput):
            return _failure(WAIT_EXPECTS_JSON)
        arguments = payload.arguments if isinstance(payload, FunctionToolArguments) else payload
        try:
            parsed = parse_wait_arguments(arguments)
            cell_id = CellId(parsed.cell_id)
            with self._spans.wait(cell_id.value):
                if parsed.terminate:
                    outcome = await self._session.terminate(cell_id)
                else:
                    request = WaitRequest(cell_id, parsed.effective_yield_time_ms)
                    outcome = await self._session.wait(request)
        except CodeModeError as error:
            return _failure(error.message)
        if isinstance(outcome, MissingCell):
            self.finish_span(cell_id, "missing")
        elif not isinstance(outcome.response, Yielded):
            self.finish_span(cell_id, outcome_of(outcome.response))
        outcome = outcome_in_source_lines(outcome, self._removed.get(cell_id, 0))
        self._track_outcome(cell_id, outcome)
        return render_outcome(outcome, self._clock() - started, parsed.effective_max_tokens)
