"""Protocol V1: strict wire messages, domain conversions, the frame codec, lanes, handshake, and
the two connection machines (:class:`ClientProtocol`, :class:`HostProtocol`).

Everything here is sans-I/O: it turns bytes into events and decisions into bytes, and never
touches a socket.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: Where each name lives. A submodule (the frame codec, say) is imported on its own without the
#: machines and every message type: the engine and a host's start-up need only a few of them.
_HOMES = {
    "ClientProtocol": "client",
    "HostProtocol": "host",
    "EOF": "codec",
    "NEED_DATA": "codec",
    "FrameDecoder": "codec",
    "MessageDecoder": "codec",
    "decode_framed": "codec",
    "encode_frame": "codec",
    "encode_payload": "codec",
    "into_framed_bytes": "codec",
    "Negotiated": "handshake",
    "check_handshake_reply": "handshake",
    "client_hello": "handshake",
    "negotiate": "handshake",
    "reject_reason_text": "handshake",
    "Lane": "lanes",
    "allows_lane": "lanes",
    "lane_of": "lanes",
    "WIRE_TYPES": "messages",
    "ClientToHost": "messages",
    "HostToClient": "messages",
    "WireRevision": "revision",
    "bulk_url": "urls",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


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
