"""Listen URLs: ``SCHEME://ADDR:PORT[/PATH]``, read the same way for every network listener."""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

__all__ = ["bracketed", "split_listen_url"]


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
