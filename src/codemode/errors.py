"""The one exception hierarchy of codemode.

Every failure that codemode raises on purpose is a :class:`CodeModeError`. Its ``str()`` and
``.message`` are exactly the protocol's message text (``protocol-v1.md`` Appendix B), so errors that
cross a wire keep their wording byte for byte.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "ArgumentTypeError",
    "CodeModeError",
    "ConnectionClosed",
    "EngineLimitError",
    "FrameError",
    "FrameErrorKind",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "WireConversionError",
]


class CodeModeError(Exception):
    """An operation or transport failure; ``str(error)`` is the exact protocol message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class WireConversionError(CodeModeError, ValueError):
    """A domain value does not fit its wire type (or back): out of range, never truncated."""

    def __init__(self, message: str = "out of range integral type conversion attempted") -> None:
        super().__init__(message)


class ArgumentTypeError(CodeModeError, TypeError):
    """A session API argument has the wrong Python type (e.g. a ``str`` where a ``CellId`` is
    required). Raised before anything is sent or run; the session stays usable."""


class FrameErrorKind(StrEnum):
    """Why a V1 frame could not be read or written (``protocol-v1.md`` §6)."""

    TRUNCATED_PREFIX = "truncated_prefix"
    TRUNCATED_PAYLOAD = "truncated_payload"
    TRAILING_BYTES = "trailing_bytes"
    OVERSIZE = "oversize"
    INVALID_JSON = "invalid_json"
    INVALID_MESSAGE = "invalid_message"


class FrameError(CodeModeError):
    """A framing, JSON or message-validation failure of one V1 frame."""

    def __init__(self, kind: FrameErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def stream_usable(self) -> bool:
        """True when the whole frame was consumed, so the next frame can still be read."""
        return self.kind in (FrameErrorKind.INVALID_JSON, FrameErrorKind.INVALID_MESSAGE)


class ProtocolError(CodeModeError):
    """A protocol rule was broken; the subclass says by whom."""


class LocalProtocolError(ProtocolError):
    """This side misused a protocol machine, or ran out of its own resources (request ids)."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; the connection cannot continue (the text is its reason)."""


class ConnectionClosed(CodeModeError):
    """The connection to the peer is gone; carries the recorded first failure reason."""


class EngineLimitError(CodeModeError):
    """Every engine process a provider may run is busy with cells: a new cell is refused (a host
    admission limit, as too many active cells)."""
