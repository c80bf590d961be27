"""How a delegate's callback ends, in one shape for every carrier (``protocol-v1.md`` §1.7, §9.6).

A nested tool call or notification served by a :class:`~codemode.session.CodeModeSessionDelegate`
ends as a :data:`CallbackResult`. The embedded runtime, the V1 client and the V1 host all speak in
these values; :func:`callback_failure` and :func:`tool_result_json` are the one place where an
exception or a returned value becomes that result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import msgspec

from codemode.errors import CodeModeError
from codemode.protocol.strict_json import non_finite_number
from codemode.protocol.texts import (
    delegate_result_not_json,
    delegate_task_failed,
)
from codemode.protocol.types import JSON

__all__ = [
    "CallbackFailed",
    "CallbackResult",
    "NotificationAccepted",
    "ToolReturned",
    "callback_failure",
    "encode_json",
    "tool_result_json",
]

_ENCODER: Final = msgspec.json.Encoder()


# Not frozen: these are made once per nested call, and a frozen dataclass's __init__ costs more.
@dataclass(slots=True)
class ToolReturned:
    """``invoke_tool`` returned ``value``."""

    value: JSON


@dataclass(slots=True)
class NotificationAccepted:
    """``notify`` returned."""


@dataclass(slots=True)
class CallbackFailed:
    """The callback failed; ``message`` is what the cell's promise rejects with."""

    message: str


CallbackResult: TypeAlias = ToolReturned | NotificationAccepted | CallbackFailed


def callback_failure(error: BaseException) -> CallbackFailed:
    """The result of a delegate that raised ``error`` (its own text for a :class:`CodeModeError`)."""
    if isinstance(error, CodeModeError):
        return CallbackFailed(error.message)
    return CallbackFailed(delegate_task_failed(str(error) or type(error).__name__))


def encode_json(value: Any) -> bytes:
    """``value`` as canonical JSON. What is not JSON raises what the encoder raises (``TypeError``,
    ``ValueError``: ``UnicodeEncodeError`` for a lone surrogate; ``RecursionError``), and NaN or
    an infinity, which a JSON encoder would write as ``null``, ``ValueError``."""
    encoded = _ENCODER.encode(value)
    if b"null" in encoded and (number := non_finite_number(value)) is not None:
        raise ValueError(f"{number} is not a JSON number")
    return encoded


def tool_result_json(value: Any) -> bytes:
    """``value`` as canonical JSON; raise :class:`CodeModeError` with the D5 text if it is not JSON.

    NaN and infinities are refused (a JSON encoder would otherwise write them as ``null``).
    """
    try:
        return encode_json(value)
    except (TypeError, ValueError, OverflowError) as error:
        raise CodeModeError(delegate_result_not_json(str(error))) from None
