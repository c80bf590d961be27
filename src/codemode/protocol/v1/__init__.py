"""Protocol V1: strict wire messages, domain conversions, the frame codec, lanes, handshake, and
the two connection machines (:class:`ClientProtocol`, :class:`HostProtocol`).

Everything here is sans-I/O: it turns bytes into events and decisions into bytes, and never
touches a socket.
"""

from codemode.protocol.v1.client import ClientProtocol
from codemode.protocol.v1.codec import (
    EOF,
    NEED_DATA,
    FrameDecoder,
    MessageDecoder,
    decode_framed,
    encode_frame,
    encode_payload,
    into_framed_bytes,
)
from codemode.protocol.v1.handshake import (
    Negotiated,
    check_handshake_reply,
    client_hello,
    negotiate,
    reject_reason_text,
)
from codemode.protocol.v1.host import HostProtocol
from codemode.protocol.v1.lanes import Lane, allows_lane, lane_of
from codemode.protocol.v1.messages import WIRE_TYPES, ClientToHost, HostToClient
from codemode.protocol.v1.revision import WireRevision
from codemode.protocol.v1.urls import bulk_url

__all__ = [
    "EOF",
    "NEED_DATA",
    "WIRE_TYPES",
    "ClientProtocol",
    "ClientToHost",
    "FrameDecoder",
    "HostProtocol",
    "HostToClient",
    "Lane",
    "MessageDecoder",
    "Negotiated",
    "WireRevision",
    "allows_lane",
    "bulk_url",
    "check_handshake_reply",
    "client_hello",
    "decode_framed",
    "encode_frame",
    "encode_payload",
    "into_framed_bytes",
    "lane_of",
    "negotiate",
    "reject_reason_text",
]
