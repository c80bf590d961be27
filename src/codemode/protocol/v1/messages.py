"""Protocol V1 wire messages as strict msgspec structs (``protocol-v1.md`` §2-§4).

Each struct spells one JSON object exactly: tag first, fields in canonical order, camelCase or
snake_case as the spec says, unknown keys rejected, ``N`` fields required but nullable and ``O``
fields omitted when :data:`UNSET` (an explicit ``null`` is rejected). Field order in a class is the
canonical encoding order.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Final, Generic, Literal, TypeAlias, TypeVar

import msgspec
from msgspec import UNSET, Meta, UnsetType, field
from msgspec.structs import force_setattr

from codemode.protocol.constants import I32_MAX, I32_MIN, I64_MAX, I64_MIN, U32_MAX, U64_MAX
from codemode.protocol.whitespace import NON_BLANK_PATTERN

__all__ = [
    "UNSET",
    "WIRE_TYPES",
    "CellClosed",
    "ClientToHost",
    "ConnectionHello",
    "ConnectionReady",
    "ConnectionRejected",
    "DelegateCancel",
    "DelegateRequest",
    "DelegateRequestMessage",
    "DelegateResponse",
    "DelegateResponseMessage",
    "ExecuteInitialResponse",
    "ExecutionStarted",
    "HandshakeRejectReason",
    "HostRequest",
    "HostResponse",
    "HostToClient",
    "InvalidHello",
    "MissingRequiredCapability",
    "NoCompatibleVersion",
    "NotificationDelivered",
    "NotificationSend",
    "OperationCancel",
    "OperationRequest",
    "OperationResponse",
    "SessionClosed",
    "SessionExecute",
    "SessionOpen",
    "SessionReady",
    "SessionShutdown",
    "SessionTerminate",
    "SessionWait",
    "ToolInvoke",
    "ToolResult",
    "UnsetType",
    "WaitCompleted",
    "WireContentItem",
    "WireError",
    "WireExecuteRequest",
    "WireImageDetail",
    "WireInputAudio",
    "WireInputImage",
    "WireInputText",
    "WireNestedToolCall",
    "WireOk",
    "WireResultBody",
    "WireRuntimeResponse",
    "WireSessionCellExecutionLimits",
    "WireTerminated",
    "WireToolDefinition",
    "WireToolKind",
    "WireToolName",
    "WireWaitOutcome",
    "WireWaitRequest",
    "WireYielded",
]

RequestId = Annotated[int, Meta(ge=I64_MIN, le=I64_MAX)]
DelegateRequestId = Annotated[int, Meta(ge=I64_MIN, le=I64_MAX)]
ProtocolVersion = Annotated[int, Meta(ge=1, le=U32_MAX)]
# msgspec bounds stop at int64, so the u64 ceiling is checked in ``__post_init__`` (_check_u64).
U64 = Annotated[int, Meta(ge=0)]
I32 = Annotated[int, Meta(ge=I32_MIN, le=I32_MAX)]
NonBlank = Annotated[str, Meta(pattern=NON_BLANK_PATTERN)]
SessionId = NonBlank
Capability = NonBlank

#: The text msgspec writes for a blank identifier, replaced by the spec's wording in error details.
BLANK_IDENTIFIER_ERROR: Final = f"Expected `str` matching regex {NON_BLANK_PATTERN!r}"
IDENTIFIER_MUST_NOT_BE_EMPTY: Final = "identifier must not be empty"

T = TypeVar("T")


class _Camel(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel", gc=False):
    """Envelope and handshake objects: camelCase keys."""


class _Snake(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Payload structs: snake_case keys."""


def _check_u64(value: object, name: str) -> None:
    if isinstance(value, int) and value > U64_MAX:
        raise ValueError(f"Expected `int` <= {U64_MAX} in `{name}`")


def _check_versions(versions: tuple[int, ...]) -> tuple[int, ...]:
    if not versions:
        raise ValueError("at least one protocol version is required")
    ordered = tuple(sorted(versions))
    for previous, current in itertools.pairwise(ordered):
        if previous == current:
            raise ValueError(f"duplicate protocol version {current}")
    return ordered


def _check_capabilities(capabilities: tuple[str, ...]) -> tuple[str, ...]:
    ordered = tuple(sorted(capabilities))
    for previous, current in itertools.pairwise(ordered):
        if previous == current:
            raise ValueError(f"duplicate capability `{current}`")
    return ordered


# -- handshake ---------------------------------------------------------------------------------


class NoCompatibleVersion(_Camel, frozen=True, tag="noCompatibleVersion", tag_field="type"):
    """The host shares no protocol version with the client; lists the host's versions."""

    supported_versions: tuple[ProtocolVersion, ...]

    def __post_init__(self) -> None:
        force_setattr(self, "supported_versions", _check_versions(self.supported_versions))


class MissingRequiredCapability(
    _Camel, frozen=True, tag="missingRequiredCapability", tag_field="type"
):
    """The host cannot grant a capability the client requires."""

    capability: Capability


class InvalidHello(_Camel, frozen=True, tag="invalidHello", tag_field="type"):
    """The first message was not a hello."""

    message: str


HandshakeRejectReason: TypeAlias = NoCompatibleVersion | MissingRequiredCapability | InvalidHello


class ConnectionHello(_Camel, frozen=True, tag="connection/hello", tag_field="type"):
    """The client's first frame."""

    supported_versions: tuple[ProtocolVersion, ...]
    required_capabilities: tuple[Capability, ...]
    optional_capabilities: tuple[Capability, ...]

    def __post_init__(self) -> None:
        force_setattr(self, "supported_versions", _check_versions(self.supported_versions))
        required = _check_capabilities(self.required_capabilities)
        optional = _check_capabilities(self.optional_capabilities)
        force_setattr(self, "required_capabilities", required)
        force_setattr(self, "optional_capabilities", optional)
        overlap = sorted(set(required) & set(optional))
        if overlap:
            raise ValueError(f"capability `{overlap[0]}` cannot be both required and optional")


class ConnectionReady(_Camel, frozen=True, tag="connection/ready", tag_field="type"):
    """The host accepted the hello; ``capabilities`` is the granted set."""

    selected_version: ProtocolVersion
    capabilities: tuple[Capability, ...]
    bulk_connection_token: str | UnsetType = UNSET

    def __post_init__(self) -> None:
        force_setattr(self, "capabilities", _check_capabilities(self.capabilities))


class ConnectionRejected(_Camel, frozen=True, tag="connection/rejected", tag_field="type"):
    """The host refused the hello."""

    reason: HandshakeRejectReason


# -- results -------------------------------------------------------------------------------------


class WireOk(
    msgspec.Struct,
    Generic[T],
    frozen=True,
    forbid_unknown_fields=True,
    gc=False,
    tag="ok",
    tag_field="status",
):
    """A successful result carrying ``value``."""

    value: T


class WireError(_Snake, frozen=True, tag="error", tag_field="status"):
    """A failed result carrying the exact error ``message``."""

    message: str


# -- payload structs (snake_case) ----------------------------------------------------------------

WireToolKind: TypeAlias = Literal["function", "freeform"]
WireImageDetail: TypeAlias = Literal["auto", "low", "high", "original"]


class WireToolName(_Snake, frozen=True):
    """A tool's name and namespace."""

    name: str
    namespace: str | None


class WireToolDefinition(_Snake, frozen=True):
    """A tool enabled for a cell; schemas are opaque JSON (``None`` = null)."""

    name: str
    tool_name: WireToolName
    description: str
    kind: WireToolKind
    input_schema: Any
    output_schema: Any


class WireExecuteRequest(_Snake, frozen=True):
    """The payload of ``session/execute``."""

    tool_call_id: str
    enabled_tools: list[WireToolDefinition]
    source: str
    yield_time_ms: U64 | None
    max_output_tokens: I32 | None

    def __post_init__(self) -> None:
        _check_u64(self.yield_time_ms, "yield_time_ms")


class WireWaitRequest(_Snake, frozen=True):
    """The payload of ``session/wait``."""

    cell_id: str
    yield_time_ms: U64

    def __post_init__(self) -> None:
        _check_u64(self.yield_time_ms, "yield_time_ms")


class WireSessionCellExecutionLimits(_Camel, frozen=True):
    """Per-session cell limits; ``{}`` means no limits."""

    max_yield_time_ms: U64 | UnsetType = UNSET
    max_heap_size_bytes: U64 | UnsetType = UNSET

    def __post_init__(self) -> None:
        _check_u64(self.max_yield_time_ms, "maxYieldTimeMs")
        _check_u64(self.max_heap_size_bytes, "maxHeapSizeBytes")


class WireInputText(_Snake, frozen=True, tag="input_text", tag_field="type"):
    """A text content item."""

    text: str


class WireInputImage(_Snake, frozen=True, tag="input_image", tag_field="type"):
    """An image content item."""

    image_url: str
    detail: WireImageDetail | UnsetType = UNSET


class WireInputAudio(_Snake, frozen=True, tag="input_audio", tag_field="type"):
    """An audio content item."""

    audio_url: str


WireContentItem: TypeAlias = WireInputText | WireInputImage | WireInputAudio


# The timing fields of the ``latest`` wire revision (``protocol-v1.md`` §0: upstream 0.152+ and
# 0.164+). They are UNSET in V1 as pinned; which revision a decoder accepts is checked after
# decoding (:func:`codemode.protocol.v1.revision.check_revision`), never loosened here.


class WireYielded(_Snake, frozen=True):
    """Body of ``{"Yielded": ...}``."""

    cell_id: str
    content_items: list[WireContentItem]
    code_mode_host_duration_ns: U64 | UnsetType = UNSET

    def __post_init__(self) -> None:
        _check_u64(self.code_mode_host_duration_ns, "code_mode_host_duration_ns")


class WireTerminated(_Snake, frozen=True):
    """Body of ``{"Terminated": ...}``."""

    cell_id: str
    content_items: list[WireContentItem]
    code_mode_host_duration_ns: U64 | UnsetType = UNSET

    def __post_init__(self) -> None:
        _check_u64(self.code_mode_host_duration_ns, "code_mode_host_duration_ns")


class WireResultBody(_Snake, frozen=True):
    """Body of ``{"Result": ...}`` (the timing fields in the order upstream writes them)."""

    cell_id: str
    content_items: list[WireContentItem]
    error_text: str | None
    result_buffered_for_ns: U64 | UnsetType = UNSET
    code_mode_host_duration_ns: U64 | UnsetType = UNSET

    def __post_init__(self) -> None:
        _check_u64(self.result_buffered_for_ns, "result_buffered_for_ns")
        _check_u64(self.code_mode_host_duration_ns, "code_mode_host_duration_ns")


def _exactly_one(values: tuple[object, ...], names: str) -> None:
    if sum(value is not UNSET for value in values) != 1:
        raise ValueError(f"expected an object with exactly one key, one of {names}")


class WireRuntimeResponse(_Snake, frozen=True):
    """An externally tagged runtime response: exactly one of the three keys."""

    yielded: WireYielded | UnsetType = field(default=UNSET, name="Yielded")
    terminated: WireTerminated | UnsetType = field(default=UNSET, name="Terminated")
    result: WireResultBody | UnsetType = field(default=UNSET, name="Result")

    def __post_init__(self) -> None:
        _exactly_one((self.yielded, self.terminated, self.result), _RUNTIME_KEYS)

    @property
    def body(self) -> WireYielded | WireTerminated | WireResultBody:
        """The one variant's body."""
        for body in (self.yielded, self.terminated, self.result):
            if not isinstance(body, UnsetType):
                return body
        raise AssertionError("unreachable: validated on construction")


_RUNTIME_KEYS: Final = "`Yielded`, `Terminated`, `Result`"
_OUTCOME_KEYS: Final = "`LiveCell`, `MissingCell`"


class WireWaitOutcome(_Snake, frozen=True):
    """An externally tagged wait outcome: ``LiveCell`` or ``MissingCell``."""

    live_cell: WireRuntimeResponse | UnsetType = field(default=UNSET, name="LiveCell")
    missing_cell: WireRuntimeResponse | UnsetType = field(default=UNSET, name="MissingCell")

    def __post_init__(self) -> None:
        _exactly_one((self.live_cell, self.missing_cell), _OUTCOME_KEYS)

    @property
    def response(self) -> WireRuntimeResponse:
        """The wrapped runtime response."""
        if isinstance(self.live_cell, UnsetType):
            assert not isinstance(self.missing_cell, UnsetType)
            return self.missing_cell
        return self.live_cell


class WireNestedToolCall(_Snake, frozen=True):
    """A cell's call of a client tool; ``input`` is opaque JSON (``None`` = null)."""

    cell_id: str
    runtime_tool_call_id: str
    tool_name: WireToolName
    tool_kind: WireToolKind
    input: Any


# -- operations ----------------------------------------------------------------------------------


class SessionOpen(_Camel, frozen=True, tag="session/open", tag_field="method"):
    """Open a session with a client-chosen id."""

    session_id: SessionId
    cell_execution_limits: WireSessionCellExecutionLimits | UnsetType = UNSET


class SessionExecute(_Camel, frozen=True, tag="session/execute", tag_field="method"):
    """Start a cell."""

    session_id: SessionId
    request: WireExecuteRequest


class SessionWait(_Camel, frozen=True, tag="session/wait", tag_field="method"):
    """Observe a cell."""

    session_id: SessionId
    request: WireWaitRequest


class SessionTerminate(_Camel, frozen=True, tag="session/terminate", tag_field="method"):
    """Stop a cell."""

    session_id: SessionId
    cell_id: str


class SessionShutdown(_Camel, frozen=True, tag="session/shutdown", tag_field="method"):
    """Close a session."""

    session_id: SessionId


HostRequest: TypeAlias = (
    SessionOpen | SessionExecute | SessionWait | SessionTerminate | SessionShutdown
)


class SessionReady(_Camel, frozen=True, tag="session/ready", tag_field="type"):
    """Answer to ``session/open``."""

    session_id: SessionId


class ExecutionStarted(_Camel, frozen=True, tag="execution/started", tag_field="type"):
    """Answer to ``session/execute``: the cell was admitted with this id."""

    cell_id: str


class WaitCompleted(_Camel, frozen=True, tag="wait/completed", tag_field="type"):
    """Answer to ``session/wait`` and ``session/terminate``."""

    outcome: WireWaitOutcome


class SessionClosed(_Camel, frozen=True, tag="session/closed", tag_field="type"):
    """Answer to ``session/shutdown``."""

    session_id: SessionId


HostResponse: TypeAlias = SessionReady | ExecutionStarted | WaitCompleted | SessionClosed


class ToolInvoke(_Camel, frozen=True, tag="tool/invoke", tag_field="type"):
    """Callback: run a nested tool."""

    invocation: WireNestedToolCall


class NotificationSend(_Camel, frozen=True, tag="notification/send", tag_field="type"):
    """Callback: deliver a ``notify(...)`` text."""

    call_id: str
    cell_id: str
    text: str


DelegateRequest: TypeAlias = ToolInvoke | NotificationSend


class ToolResult(_Camel, frozen=True, tag="tool/result", tag_field="type"):
    """A nested tool's JSON result (``null`` allowed)."""

    result: Any


class NotificationDelivered(_Camel, frozen=True, tag="notification/delivered", tag_field="type"):
    """A notification was delivered."""


DelegateResponse: TypeAlias = ToolResult | NotificationDelivered


# -- envelopes -----------------------------------------------------------------------------------


class OperationRequest(_Camel, frozen=True, tag="operation/request", tag_field="type"):
    """Start operation ``id``."""

    id: RequestId
    request: HostRequest


class OperationCancel(_Camel, frozen=True, tag="operation/cancel", tag_field="type"):
    """Ask to cancel operation ``id``."""

    id: RequestId


class DelegateResponseMessage(_Camel, frozen=True, tag="delegate/response", tag_field="type"):
    """Answer callback ``id``."""

    id: DelegateRequestId
    result: WireOk[DelegateResponse] | WireError


ClientToHost: TypeAlias = (
    ConnectionHello | OperationRequest | OperationCancel | DelegateResponseMessage
)


class OperationResponse(_Camel, frozen=True, tag="operation/response", tag_field="type"):
    """The one answer to operation ``id``."""

    id: RequestId
    result: WireOk[HostResponse] | WireError


class ExecuteInitialResponse(_Camel, frozen=True, tag="execute/initialResponse", tag_field="type"):
    """The first outcome of the cell admitted by execute ``id``."""

    id: RequestId
    result: WireOk[WireRuntimeResponse] | WireError


class DelegateRequestMessage(_Camel, frozen=True, tag="delegate/request", tag_field="type"):
    """Callback ``id`` to the client, for a cell of ``session_id``."""

    id: DelegateRequestId
    session_id: SessionId
    request: DelegateRequest


class DelegateCancel(_Camel, frozen=True, tag="delegate/cancel", tag_field="type"):
    """Revoke callback ``id``."""

    id: DelegateRequestId


class CellClosed(_Camel, frozen=True, tag="cell/closed", tag_field="type"):
    """The cell is gone; release its state."""

    session_id: SessionId
    cell_id: str


HostToClient: TypeAlias = (
    ConnectionReady
    | ConnectionRejected
    | OperationResponse
    | ExecuteInitialResponse
    | DelegateRequestMessage
    | DelegateCancel
    | CellClosed
)


def message_type(message: object) -> str:
    """The tag of a tagged wire message (``"operation/cancel"``), else its class name."""
    config = getattr(type(message), "__struct_config__", None)
    tag = getattr(config, "tag", None)
    return str(tag) if tag is not None else type(message).__name__


#: Every wire type by the name the specification and its vectors use.
WIRE_TYPES: Final[dict[str, Any]] = {
    "ClientToHost": ClientToHost,
    "HostToClient": HostToClient,
    "HostRequest": HostRequest,
    "HostResponse": HostResponse,
    "DelegateRequest": DelegateRequest,
    "DelegateResponse": DelegateResponse,
    "WireExecuteRequest": WireExecuteRequest,
    "WireWaitRequest": WireWaitRequest,
    "WireRuntimeResponse": WireRuntimeResponse,
    "WireWaitOutcome": WireWaitOutcome,
    "WireNestedToolCall": WireNestedToolCall,
    "WireToolDefinition": WireToolDefinition,
    "WireToolName": WireToolName,
    "WireContentItem": WireContentItem,
    "WireSessionCellExecutionLimits": WireSessionCellExecutionLimits,
    "HandshakeRejectReason": HandshakeRejectReason,
}
