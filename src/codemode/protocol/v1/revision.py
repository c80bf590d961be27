"""Wire revisions of V1 (``protocol-v1.md`` §0; ``docs/decisions/0007-wire-revisions.md``).

Every upstream release keeps ``selectedVersion: 1`` and the same handshake, but from 0.152 on the
runtime response bodies carry timing fields. Two revisions are spoken here:

* ``pinned`` (the default): V1 as pinned. No timing field; one is an unknown key and rejected.
* ``latest`` (upstream 0.164+): every ``Yielded``, ``Terminated`` and ``Result`` body carries a
  required ``code_mode_host_duration_ns`` (u64) and every ``Result`` body also a required
  ``result_buffered_for_ns`` (u64). A body without them is rejected.

The wire structs hold the fields as optional (``UNSET``) so that one set of types serves both;
:func:`check_revision` is what makes a decoded message obey one revision, with the same error
text msgspec gives for an unknown or a missing key. :class:`~codemode.protocol.v1.codec.
MessageDecoder` applies it to every message it decodes.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from codemode.protocol.constants import (
    DUAL_WEBSOCKET_CAPABILITY,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.protocol.v1.messages import (
    UNSET,
    ConnectionHello,
    ExecuteInitialResponse,
    OperationResponse,
    UnsetType,
    WaitCompleted,
    WireOk,
    WireResultBody,
    WireRuntimeResponse,
    WireTerminated,
    WireWaitOutcome,
    WireYielded,
)

__all__ = [
    "AUTO_REVISION",
    "BUFFERED_FIELD",
    "DURATION_FIELD",
    "WireRevision",
    "check_revision",
    "revision_for_hello",
]

DURATION_FIELD: Final = "code_mode_host_duration_ns"
BUFFERED_FIELD: Final = "result_buffered_for_ns"


class WireRevision(StrEnum):
    """Which shape of the runtime response bodies a peer speaks."""

    #: V1 as pinned (``protocol-v1.md``; upstream 0.147-0.150): no timing fields.
    PINNED = "pinned"
    #: Upstream 0.164+ (checked against 0.171.0): both timing fields, required.
    LATEST = "latest"


#: A host's ``wire_revision`` that reads the revision off each client's hello
#: (:func:`revision_for_hello`); not a revision of its own, and meaningless to a decoder.
AUTO_REVISION: Final = "auto"
#: The capabilities V1 as pinned defines.
PINNED_CAPABILITIES: Final = frozenset(
    {SESSION_RESOURCE_LIMITS_CAPABILITY, DUAL_WEBSOCKET_CAPABILITY}
)


def revision_for_hello(hello: ConnectionHello) -> WireRevision:
    """``latest`` when ``hello`` lists a capability V1 as pinned does not define, else ``pinned``.

    Both revisions greet the same way, but upstream clients that require the timing fields
    (0.171 offers ``bounded-output-v1``, ``yield-observation``, ...) also offer capabilities that
    came after the pinned revision, while a pinned client (0.149 offers only
    ``session-cell-execution-resource-limits``) offers none: the one observable difference
    before the first runtime response. A heuristic, for hosts that serve both (a drop-in
    ``codex-code-mode-host``); a host that knows its clients says ``pinned`` or ``latest``.
    """
    listed = set(hello.required_capabilities) | set(hello.optional_capabilities)
    return WireRevision.LATEST if listed - PINNED_CAPABILITIES else WireRevision.PINNED


def check_revision(message: object, revision: WireRevision) -> str | None:
    """The decode error detail if ``message`` does not have ``revision``'s shape, else ``None``.

    Only messages that can hold a runtime response are looked into: ``execute/initialResponse``,
    ``operation/response`` with ``wait/completed``, and those payloads decoded on their own.
    """
    found = _runtime_response(message)
    if found is None:
        return None
    response, path = found
    if not isinstance(response.yielded, UnsetType):
        return _check_body(response.yielded, (DURATION_FIELD,), revision, f"{path}.Yielded")
    if not isinstance(response.terminated, UnsetType):
        return _check_body(response.terminated, (DURATION_FIELD,), revision, f"{path}.Terminated")
    fields = (BUFFERED_FIELD, DURATION_FIELD)
    return _check_body(response.body, fields, revision, f"{path}.Result")


def _runtime_response(message: object) -> tuple[WireRuntimeResponse, str] | None:
    if isinstance(message, ExecuteInitialResponse):
        result = message.result
        if isinstance(result, WireOk) and isinstance(result.value, WireRuntimeResponse):
            return result.value, "$.result.value"
        return None
    if isinstance(message, OperationResponse):
        answer = message.result
        if isinstance(answer, WireOk) and isinstance(answer.value, WaitCompleted):
            return _outcome(answer.value.outcome, "$.result.value.outcome")
        return None
    if isinstance(message, WaitCompleted):
        return _outcome(message.outcome, "$.outcome")
    if isinstance(message, WireWaitOutcome):
        return _outcome(message, "$")
    if isinstance(message, WireRuntimeResponse):
        return message, "$"
    return None


def _outcome(outcome: WireWaitOutcome, path: str) -> tuple[WireRuntimeResponse, str]:
    key = "MissingCell" if outcome.live_cell is UNSET else "LiveCell"
    return outcome.response, f"{path}.{key}"


def _check_body(
    body: WireYielded | WireTerminated | WireResultBody,
    fields: tuple[str, ...],
    revision: WireRevision,
    path: str,
) -> str | None:
    for name in fields:
        present = getattr(body, name) is not UNSET
        if revision is WireRevision.PINNED and present:
            return f"Object contains unknown field `{name}` - at `{path}`"
        if revision is WireRevision.LATEST and not present:
            return f"Object missing required field `{name}` - at `{path}`"
    return None
