"""OpenTelemetry spans for cells and their nested calls (``pip install 'codemode[otel]'``).

With ``opentelemetry-api`` installed, the tracer ``codemode`` records:

* ``codemode.cell``: one span per ``exec``, a child of the span that was current where the exec
  was handled; it lasts until the cell ends (its first terminal outcome reaches the handler, or
  the cell is closed), with the attributes ``codemode.tool_call_id``, ``codemode.cell_id`` and
  ``codemode.outcome`` (``completed``, ``failed``, ``terminated``, ``missing``, ``closed``, or
  ``error`` when the exec itself failed);
* ``codemode.tool_call``: one span per nested call, a child of its cell's span (``codemode.tool``,
  ``codemode.cell_id``; an error status and the exception when the call fails);
* ``codemode.wait``: one span per ``wait`` call.

Without the package nothing is imported or recorded; nor while no tracer provider is set (the
API alone records nothing, and its no-op spans would still cost a nested call several µs). A
nested call finds its cell's span in the context it runs in: every carrier runs a cell's callbacks
in the context of the ``execute`` that started it (``codemode.session.cell_context``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any, Final

from codemode.protocol.types import CellId, MissingCell, Result, RuntimeResponse, Terminated

__all__ = ["CellSpan", "CellSpans", "enabled"]

#: How long after its closure a cell's span waits for the cell's outcome.
CLOSE_GRACE: Final = 1.0

_trace: Any = None
_loaded = False
_cached: tuple[Any, Any] = (None, None)  # (provider, its codemode tracer)
_UNKNOWN: Final = object()
# OpenTelemetry makes a provider named by this variable on first use.
_provider_from_environment = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def _get_tracer() -> Any:
    """The ``codemode`` tracer, or ``None`` without the package or a configured provider."""
    global _trace, _loaded, _cached
    if not _loaded:
        _loaded = True
        try:
            from opentelemetry import trace
        except ImportError:
            return None
        _trace = trace
    if _trace is None:
        return None
    # The API's own getter reads os.environ on every call while no provider is set (≈0.8 µs, a
    # tenth of a nested call's registry work): its module global answers "none set" for free.
    provider = getattr(_trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is None and not _provider_from_environment:
        return None
    provider = _trace.get_tracer_provider()
    if isinstance(provider, _trace.ProxyTracerProvider):
        return None
    if _cached[0] is not provider:
        _cached = (provider, provider.get_tracer("codemode"))
    return _cached[1]


def enabled() -> bool:
    """Whether spans are recorded (``opentelemetry-api`` is importable and a provider is set)."""
    return _get_tracer() is not None


def outcome_of(response: RuntimeResponse | MissingCell) -> str:
    """The ``codemode.outcome`` of a terminal outcome."""
    if isinstance(response, MissingCell):
        return "missing"
    if isinstance(response, Terminated):
        return "terminated"
    if isinstance(response, Result):
        return "failed" if response.error_text is not None else "completed"
    return "yielded"


class CellSpan:
    """One open ``codemode.cell`` span; ended once, by whichever comes first: its outcome, a
    failure, or (after :data:`CLOSE_GRACE`) the cell's closure."""

    __slots__ = ("ended", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.ended = False

    def bind(self, cell_id: CellId) -> None:
        """The span is ``cell_id``'s."""
        self.span.set_attribute("codemode.cell_id", cell_id.value)

    def finish(self, outcome: str) -> None:
        """End the span (if it is still open) with ``outcome``."""
        if not self.ended:
            self.ended = True
            self.span.set_attribute("codemode.outcome", outcome)
            self.span.end()

    def fail(self, message: str) -> None:
        """End the span of an exec that failed before or while its cell ran."""
        if self.ended:
            return
        from opentelemetry.trace import Status, StatusCode

        self.ended = True
        self.span.set_attribute("codemode.outcome", "error")
        self.span.set_status(Status(StatusCode.ERROR, message))
        self.span.end()


#: The span of the cell whose code runs: set while its exec is admitted, so the cell's context
#: (session.cell_context: its delegate callbacks run in it, on every carrier) carries it.
_CURRENT_CELL: contextvars.ContextVar[CellSpan | None] = contextvars.ContextVar(
    "codemode_cell_span", default=None
)


class CellSpans:
    """Starts cell spans and the spans of their nested calls and waits.

    Holds no state: a nested call finds its cell's span in the context it runs in (that of the
    cell's exec), so one registry may serve the cells of many sessions whose ids overlap.
    """

    def start_cell(self, call_id: str) -> CellSpan | None:
        """A new cell span (a child of the current span), or ``None`` when not tracing."""
        tracer = _get_tracer()
        if tracer is None:
            return None
        span = tracer.start_span("codemode.cell", attributes={"codemode.tool_call_id": call_id})
        return CellSpan(span)

    @contextlib.contextmanager
    def executing(self, cell: CellSpan | None) -> Iterator[None]:
        """Around the ``execute`` of ``cell``'s exec: its callbacks will run under it."""
        if cell is None:
            yield
            return
        token = _CURRENT_CELL.set(cell)
        try:
            yield
        finally:
            _CURRENT_CELL.reset(token)

    def closed(self, cell_id: CellId) -> None:
        """The cell whose context this runs in is gone. Its outcome usually reaches the handler
        just after (the closure follows the delivery): the span ends with ``closed`` only if it
        has not by then."""
        cell = _CURRENT_CELL.get()
        if cell is not None and not cell.ended:
            with contextlib.suppress(RuntimeError):  # no running loop: leave it to the handler
                asyncio.get_running_loop().call_later(CLOSE_GRACE, cell.finish, "closed")

    @contextlib.contextmanager
    def tool_call(self, cell_id: CellId, tool: str) -> Iterator[None]:
        """A ``codemode.tool_call`` span around one nested call of ``cell_id``."""
        tracer = _get_tracer()
        if tracer is None:
            yield
            return
        from opentelemetry import trace

        cell = _CURRENT_CELL.get()
        context = None if cell is None else trace.set_span_in_context(cell.span)
        attributes = {"codemode.tool": tool, "codemode.cell_id": cell_id.value}
        with tracer.start_as_current_span(
            "codemode.tool_call", context=context, attributes=attributes
        ):
            yield

    @contextlib.contextmanager
    def wait(self, cell_id: str) -> Iterator[None]:
        """A ``codemode.wait`` span (a child of the current span)."""
        tracer = _get_tracer()
        if tracer is None:
            yield
            return
        with tracer.start_as_current_span(
            "codemode.wait", attributes={"codemode.cell_id": cell_id}
        ):
            yield
