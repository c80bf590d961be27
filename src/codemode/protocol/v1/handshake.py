"""Handshake helpers (``protocol-v1.md`` §3): the client hello, host negotiation, reply checks."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from codemode.errors import RemoteProtocolError
from codemode.protocol.constants import (
    DUAL_WEBSOCKET_CAPABILITY,
    PROTOCOL_VERSION_V1,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.protocol.v1.messages import (
    UNSET,
    ClientToHost,
    ConnectionHello,
    ConnectionReady,
    ConnectionRejected,
    HandshakeRejectReason,
    HostToClient,
    InvalidHello,
    MissingRequiredCapability,
    NoCompatibleVersion,
    message_type,
)
from codemode.protocol.v1.texts import (
    FIRST_MESSAGE_MUST_BE_HELLO,
    handshake_rejected,
    invalid_handshake_reply,
    invalid_hello,
    missing_required_capability,
    no_compatible_version,
)

__all__ = [
    "HOST_SUPPORTED_VERSIONS",
    "Negotiated",
    "check_handshake_reply",
    "client_hello",
    "negotiate",
    "reject_reason_text",
]

HOST_SUPPORTED_VERSIONS: Final = (PROTOCOL_VERSION_V1,)


def client_hello(*, dual_websocket: bool = False) -> ConnectionHello:
    """The hello this project's clients send (§3.4)."""
    optional = [SESSION_RESOURCE_LIMITS_CAPABILITY]
    if dual_websocket:
        optional.append(DUAL_WEBSOCKET_CAPABILITY)
    return ConnectionHello((PROTOCOL_VERSION_V1,), (), tuple(optional))


@dataclass(frozen=True, slots=True)
class Negotiated:
    """A successful negotiation: what was granted."""

    capabilities: frozenset[str]
    bulk_connection_token: str | None

    @property
    def dual_websocket(self) -> bool:
        """True when a bulk socket must be paired."""
        return DUAL_WEBSOCKET_CAPABILITY in self.capabilities

    @property
    def resource_limits(self) -> bool:
        """True when ``session/open`` may carry cell execution limits."""
        return SESSION_RESOURCE_LIMITS_CAPABILITY in self.capabilities


def negotiate(
    first: ClientToHost,
    host_capabilities: Iterable[str],
    *,
    new_token: Callable[[], str] = lambda: secrets.token_urlsafe(24),
) -> tuple[ConnectionReady | ConnectionRejected, Negotiated | None]:
    """Answer the client's first message (§3.3 steps 2-6): the reply, and the grant if ready."""
    if not isinstance(first, ConnectionHello):
        return ConnectionRejected(InvalidHello(FIRST_MESSAGE_MUST_BE_HELLO)), None
    if PROTOCOL_VERSION_V1 not in first.supported_versions:
        return ConnectionRejected(NoCompatibleVersion(HOST_SUPPORTED_VERSIONS)), None
    supported = set(host_capabilities)
    requested = set(first.required_capabilities) | set(first.optional_capabilities)
    granted = requested & supported
    missing = sorted(set(first.required_capabilities) - granted)
    if missing:
        return ConnectionRejected(MissingRequiredCapability(missing[0])), None
    token = new_token() if DUAL_WEBSOCKET_CAPABILITY in granted else None
    ready = ConnectionReady(
        PROTOCOL_VERSION_V1, tuple(sorted(granted)), UNSET if token is None else token
    )
    return ready, Negotiated(frozenset(granted), token)


def reject_reason_text(reason: HandshakeRejectReason) -> str:
    """The display form of a rejection reason (§3.1)."""
    if isinstance(reason, NoCompatibleVersion):
        return no_compatible_version(", ".join(str(v) for v in sorted(reason.supported_versions)))
    if isinstance(reason, MissingRequiredCapability):
        return missing_required_capability(reason.capability)
    return invalid_hello(reason.message)


def check_handshake_reply(hello: ConnectionHello, reply: HostToClient) -> Negotiated:
    """Validate the host's reply to ``hello`` (§3.4); raise :class:`RemoteProtocolError` with
    the C4 or C5 text."""
    if isinstance(reply, ConnectionRejected):
        raise RemoteProtocolError(handshake_rejected(reject_reason_text(reply.reason)))
    if not isinstance(reply, ConnectionReady):
        raise _invalid(f"expected connection/ready, got {message_type(reply)}")
    if reply.selected_version not in hello.supported_versions:
        raise _invalid(f"host selected unsupported protocol version {reply.selected_version}")
    listed = set(hello.required_capabilities) | set(hello.optional_capabilities)
    for capability in reply.capabilities:
        if capability not in listed:
            raise _invalid(f"host granted unrequested capability `{capability}`")
    for capability in hello.required_capabilities:
        if capability not in reply.capabilities:
            raise _invalid(f"host did not grant required capability `{capability}`")
    dual = DUAL_WEBSOCKET_CAPABILITY in reply.capabilities
    token = None if reply.bulk_connection_token is UNSET else reply.bulk_connection_token
    if dual and token is None:
        raise _invalid("bulkConnectionToken is missing")
    if not dual and token is not None:
        raise _invalid(f"bulkConnectionToken without `{DUAL_WEBSOCKET_CAPABILITY}`")
    return Negotiated(frozenset(reply.capabilities), token)


def _invalid(detail: str) -> RemoteProtocolError:
    return RemoteProtocolError(invalid_handshake_reply(detail))
