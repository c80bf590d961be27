"""Listen URLs (``SCHEME://ADDR:PORT[/PATH]``, read the same way for every network listener) and
the listeners' defaults; light enough for the command line to import before it knows which
listener it will start."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final
from urllib.parse import SplitResult, urlsplit

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_PING_INTERVAL",
    "DEFAULT_PING_TIMEOUT",
    "MIN_CLIENT_PING_INTERVAL",
    "WebSocketAddress",
    "bracketed",
    "is_loopback",
    "split_listen_url",
]


def split_listen_url(url: str, scheme: str, shape: str) -> tuple[SplitResult, str, int]:
    """The parts of a listen URL, its host (loopback when absent) and its port; raise
    :class:`ValueError` naming what is wrong (``shape`` is the form to show, e.g.
    ``ws://ADDR:PORT[/PATH]``)."""
    parts = urlsplit(url)
    if parts.scheme != scheme:
        raise ValueError(f"{url}: expected {shape}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{url}: a listen URL has no query, fragment or user")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url}: the port must be 0-65535") from None
    if port is None:
        raise ValueError(f"{url}: a port is required (0 picks a free one)")
    return parts, parts.hostname or "127.0.0.1", port


def bracketed(host: str) -> str:
    """``host`` as it goes before ``:PORT`` (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


DEFAULT_MAX_CONNECTIONS: Final = 64
#: Seconds between keepalive pings, and how long a pong may take before the connection (and
#: its sessions) end: a half-open TCP connection is noticed within their sum.
DEFAULT_PING_INTERVAL: Final = 20.0
DEFAULT_PING_TIMEOUT: Final = 20.0
#: gRPC: clients may send their own keepalive pings this often while they send nothing else (more
#: often: GOAWAY ``too_many_pings``).
MIN_CLIENT_PING_INTERVAL: Final = 10.0


@dataclass(frozen=True, slots=True)
class WebSocketAddress:
    """Where to listen: ``ws://ADDR:PORT[/PATH]`` (``PORT`` 0 picks a free port)."""

    host: str
    port: int
    path: str = "/"

    @classmethod
    def parse(cls, url: str) -> WebSocketAddress:
        """Parse a listen URL; raise :class:`ValueError` saying what is wrong with it."""
        parts, host, port = split_listen_url(url, "ws", "ws://ADDR:PORT[/PATH]")
        return cls(host, port, parts.path or "/")

    def url(self, port: int | None = None) -> str:
        """The control URL clients connect to (no trailing slash for the root path)."""
        path = "" if self.path == "/" else self.path
        return f"ws://{bracketed(self.host)}:{self.port if port is None else port}{path}"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
