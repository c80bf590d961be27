"""Domain value types shared by every carrier and the runtime (``protocol-v1.md`` §1.1, §1.3).

These are what Python callers use. They do not validate on construction; conversions to a wire
form do (see :mod:`codemode.protocol.v1.conversions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeAlias

__all__ = [
    "JSON",
    "CellId",
    "CodeModeNestedToolCall",
    "CodeModeSessionCellExecutionLimits",
    "CodeModeToolKind",
    "ContentItem",
    "ExecuteRequest",
    "ImageDetail",
    "InputAudio",
    "InputImage",
    "InputText",
    "LiveCell",
    "MissingCell",
    "Result",
    "RuntimeResponse",
    "Terminated",
    "ToolCallSite",
    "ToolDefinition",
    "ToolName",
    "WaitOutcome",
    "WaitRequest",
    "Yielded",
]

#: A JSON value: dict (str keys), list, str, int, finite float, bool or None.
JSON: TypeAlias = Any


@dataclass(frozen=True, slots=True)
class CellId:
    """An opaque, host-chosen cell id; ``str(cell_id)`` is the exact id string."""

    value: str

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"CellId({self.value!r})"


@dataclass(frozen=True, slots=True)
class ToolName:
    """A tool's name and optional namespace (e.g. an MCP server prefix)."""

    name: str
    namespace: str | None = None

    @classmethod
    def plain(cls, name: str) -> ToolName:
        """A name without namespace."""
        return cls(name, None)

    @classmethod
    def namespaced(cls, namespace: str, name: str) -> ToolName:
        """A name inside ``namespace``."""
        return cls(name, namespace)


class CodeModeToolKind(StrEnum):
    """How a nested tool takes its input: a JSON object (function) or a string (freeform)."""

    FUNCTION = "function"
    FREEFORM = "freeform"


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    """A tool enabled for a cell; schemas are opaque JSON."""

    name: str
    tool_name: ToolName
    description: str
    kind: CodeModeToolKind = CodeModeToolKind.FUNCTION
    input_schema: JSON = None
    output_schema: JSON = None


class ImageDetail(StrEnum):
    """Resolution hint of an image content item."""

    AUTO = "auto"
    LOW = "low"
    HIGH = "high"
    ORIGINAL = "original"


@dataclass(frozen=True, slots=True)
class InputText:
    """A text content item."""

    text: str


@dataclass(frozen=True, slots=True)
class InputImage:
    """An image content item (usually a ``data:`` URL)."""

    image_url: str
    detail: ImageDetail | None = None


@dataclass(frozen=True, slots=True)
class InputAudio:
    """An audio content item (usually a ``data:`` URL)."""

    audio_url: str


ContentItem: TypeAlias = InputText | InputImage | InputAudio


@dataclass(frozen=True, slots=True)
class ExecuteRequest:
    """Run one cell. ``source`` is JavaScript after pragma parsing."""

    tool_call_id: str
    source: str
    enabled_tools: list[ToolDefinition] = field(default_factory=list)
    yield_time_ms: int | None = None
    max_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class WaitRequest:
    """Observe a running cell for up to ``yield_time_ms``."""

    cell_id: CellId
    yield_time_ms: int


# Timing (the ``latest`` wire revision, docs/decisions/0007-wire-revisions.md): ``host_duration_ns``
# is the host's ``code_mode_host_duration_ns`` (how long the host spent on the operation that
# answered), ``result_buffered_for_ns`` how long a completed result waited before delivery. Both
# are ``None`` when the carrier does not report them (the embedded runtime, V1 as pinned), and
# neither takes part in equality: they describe a delivery, not the cell's outcome.


@dataclass(frozen=True, slots=True)
class Yielded:
    """The cell is still running; these items were produced since the last observation."""

    cell_id: CellId
    content_items: list[ContentItem] = field(default_factory=list)
    host_duration_ns: int | None = field(default=None, compare=False, kw_only=True)


@dataclass(frozen=True, slots=True)
class Terminated:
    """The cell was terminated."""

    cell_id: CellId
    content_items: list[ContentItem] = field(default_factory=list)
    host_duration_ns: int | None = field(default=None, compare=False, kw_only=True)


@dataclass(frozen=True, slots=True)
class ToolCallSite:
    """Where a cell called a tool: ``tools.<tool>`` at ``exec_main.mjs:<line>:<column>``."""

    tool: str
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Result:
    """The cell completed; ``error_text`` is set when the script failed.

    ``failed_call`` is where the cell called the tool whose failure text ``error_text`` is (the
    cell did not catch it). Only the embedded runtime knows it: no wire protocol carries it.
    """

    cell_id: CellId
    content_items: list[ContentItem] = field(default_factory=list)
    error_text: str | None = None
    host_duration_ns: int | None = field(default=None, compare=False, kw_only=True)
    result_buffered_for_ns: int | None = field(default=None, compare=False, kw_only=True)
    failed_call: ToolCallSite | None = field(default=None, compare=False, kw_only=True)


RuntimeResponse: TypeAlias = Yielded | Terminated | Result


@dataclass(frozen=True, slots=True)
class LiveCell:
    """The observed cell existed when the request was served."""

    response: RuntimeResponse


@dataclass(frozen=True, slots=True)
class MissingCell:
    """The observed cell id is unknown or already closed."""

    response: RuntimeResponse


WaitOutcome: TypeAlias = LiveCell | MissingCell


@dataclass(frozen=True, slots=True)
class CodeModeNestedToolCall:
    """A cell's call of one of the client's tools; ``input`` is ``None`` when there is none."""

    cell_id: CellId
    runtime_tool_call_id: str
    tool_name: ToolName
    tool_kind: CodeModeToolKind
    input: JSON = None


@dataclass(frozen=True, slots=True)
class CodeModeSessionCellExecutionLimits:
    """Limits shared by every cell of one session; ``None`` means no limit."""

    max_yield_time_ms: int | None = None
    max_heap_size_bytes: int | None = None

    @property
    def is_default(self) -> bool:
        """True when no limit is set."""
        return self.max_yield_time_ms is None and self.max_heap_size_bytes is None
