"""The identifier rules of the gRPC carriage (``grpc.md`` §3), for both sides.

* A host checks what a client sent: :func:`check_request_identifier` raises
  :class:`~codemode.errors.WireConversionError` with ``code-mode ⟨what⟩ ID ⟨reason⟩`` (upstream
  0.171.0's texts), which the host answers with ``INVALID_ARGUMENT`` (§12.1). Ids that must be
  UUIDs are looked up by their :func:`canonical_uuid`, as upstream does (it parses them).
* A client checks what a host sent: :func:`check_host_identifier`, :func:`check_invocation_id` and
  :func:`check_notification_id` raise :class:`~codemode.errors.RemoteProtocolError`: the host broke
  the protocol and the session fails (§10 †, §13.4).

Lengths are counted in UTF-8 bytes. "A UUID" is any of the four spellings the reference parses
(``Uuid::parse_str``): 32 hex digits, hyphenated 8-4-4-4-12, that in braces, or that after
``urn:uuid:``; hex digits in either case, any version. Hosts always send the hyphenated form.
"""

from __future__ import annotations

import re
import uuid as uuid_module
from typing import Final

from codemode.errors import RemoteProtocolError, WireConversionError
from codemode.protocol.grpc import texts
from codemode.protocol.grpc.constants import MAX_IDENTIFIER_BYTES

__all__ = [
    "canonical_uuid",
    "check_host_identifier",
    "check_invocation_id",
    "check_notification_id",
    "check_request_identifier",
    "identifier_bytes",
    "is_uuid",
]

_HYPHENATED: Final = r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"
_UUID: Final = re.compile(
    rf"[0-9A-Fa-f]{{32}}|{_HYPHENATED}|\{{{_HYPHENATED}\}}|urn:uuid:{_HYPHENATED}"
)


def identifier_bytes(value: str) -> int:
    """The length of ``value`` in UTF-8 bytes (a lone surrogate counts as its three bytes)."""
    if value.isascii():
        return len(value)
    return len(value.encode("utf-8", "surrogatepass"))


def is_uuid(value: str) -> bool:
    """True when ``value`` parses as a UUID (see the module docstring for the spellings)."""
    return _UUID.fullmatch(value) is not None


def canonical_uuid(value: str) -> str:
    """The lower-case hyphenated spelling of a UUID ``value`` (one :func:`is_uuid` accepts)."""
    return str(uuid_module.UUID(value))


def _too_long(value: str) -> bool:
    # Four bytes per character at most: short identifiers skip the encoding.
    return len(value) > MAX_IDENTIFIER_BYTES // 4 and identifier_bytes(value) > MAX_IDENTIFIER_BYTES


def check_request_identifier(field: str, value: str, *, uuid: bool = False) -> str:
    """Host side: ``value`` (the proto field ``field``) is non-empty, at most 256 bytes and, when
    ``uuid``, a UUID; return it, else raise ``code-mode ⟨what⟩ ID ⟨reason⟩``.

    A host requires UUIDs of ``session_id``, ``invocation_id`` and ``notification_id`` (upstream
    0.171.0 parses all three); ``execution_id``, ``wait_id``, ``tool_call_id`` and ``cell_id``
    are bounded but opaque.
    """
    if not value:
        raise WireConversionError(texts.invalid_identifier(field, texts.IDENTIFIER_EMPTY))
    if _too_long(value):
        raise WireConversionError(texts.invalid_identifier(field, texts.IDENTIFIER_TOO_LONG))
    if uuid and not is_uuid(value):
        raise WireConversionError(texts.invalid_identifier(field, texts.IDENTIFIER_NOT_UUID))
    return value


def check_host_identifier(what: str, value: str) -> str:
    """Client side: an identifier the host returned is non-empty and at most 256 bytes.

    ``what`` names it in the text: ``session ID``, ``cell ID``, ``tool call ID`` or
    ``notification call ID`` (``gRPC code-mode host returned an empty cell ID``, ``gRPC code-mode
    host returned cell ID exceeding 256 bytes``).
    """
    if not value:
        raise RemoteProtocolError(texts.host_returned_empty_identifier(what))
    if _too_long(value):
        raise RemoteProtocolError(texts.host_returned_long_identifier(what))
    return value


def check_invocation_id(value: str) -> str:
    """Client side: a ``ToolCall``'s (or ``ToolCallCancelled``'s) ``invocation_id`` is a UUID."""
    if not is_uuid(value):
        raise RemoteProtocolError(texts.INVOCATION_ID_NOT_UUID)
    return value


def check_notification_id(value: str) -> str:
    """Client side: a ``Notification``'s (or its cancellation's) ``notification_id`` is a UUID."""
    if not is_uuid(value):
        raise RemoteProtocolError(texts.NOTIFICATION_ID_NOT_UUID)
    return value
