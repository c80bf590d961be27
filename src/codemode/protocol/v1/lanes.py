"""Control and bulk lanes of a dual-WebSocket connection (``protocol-v1.md`` §7.3).

Each message family has exactly one legal lane, decided by the decoded message alone (never by its
size): tool callbacks and their results travel on the bulk socket, everything else on control.
"""

from __future__ import annotations

from enum import StrEnum

from codemode.protocol.v1.messages import (
    ClientToHost,
    DelegateCancel,
    DelegateRequestMessage,
    DelegateResponseMessage,
    HostToClient,
    NotificationDelivered,
    ToolInvoke,
    WireOk,
)

__all__ = ["Lane", "allows_lane", "lane_of"]


class Lane(StrEnum):
    """The socket a message must travel on."""

    CONTROL = "control"
    BULK = "bulk"


def lane_of(message: ClientToHost | HostToClient) -> Lane:
    """The one lane on which ``message`` is allowed."""
    if isinstance(message, DelegateResponseMessage):
        result = message.result
        if isinstance(result, WireOk) and isinstance(result.value, NotificationDelivered):
            return Lane.CONTROL
        return Lane.BULK
    if isinstance(message, DelegateCancel):
        return Lane.BULK
    if isinstance(message, DelegateRequestMessage) and isinstance(message.request, ToolInvoke):
        return Lane.BULK
    return Lane.CONTROL


def allows_lane(message: ClientToHost | HostToClient, lane: Lane) -> bool:
    """True when ``message`` may travel on ``lane``."""
    return lane_of(message) is Lane(lane)
