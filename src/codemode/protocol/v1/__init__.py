"""Protocol V1: strict wire messages, domain conversions, the frame codec, lanes, handshake.

Everything here is sans-I/O: it turns bytes into messages and messages into bytes, and never
touches a socket.
"""

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
from codemode.protocol.v1.lanes import Lane, allows_lane, bulk_url, lane_of
from codemode.protocol.v1.messages import WIRE_TYPES, ClientToHost, HostToClient
from codemode.protocol.v1.revision import WireRevision

__all__ = [
    "EOF",
    "NEED_DATA",
    "WIRE_TYPES",
    "ClientToHost",
    "FrameDecoder",
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
