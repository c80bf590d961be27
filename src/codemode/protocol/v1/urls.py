"""Where the bulk socket of a dual WebSocket connection is (``protocol-v1.md`` §7.3)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

__all__ = ["bulk_url"]


def bulk_url(control_url: str, token: str) -> str:
    """The bulk socket URL for a control URL and a ``bulkConnectionToken``: the control URL's
    path without its trailing ``/``, then ``/bulk/{token}``, its query string kept."""
    parts = urlsplit(control_url)
    path = parts.path.rstrip("/") + "/bulk/" + token
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))
