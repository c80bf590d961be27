"""The bearer-token check both network listeners share (``Authorization: Bearer <token>``)."""

from __future__ import annotations

import hmac

__all__ = ["bearer_token_matches"]


def bearer_token_matches(authorization: bytes, token: bytes) -> bool:
    """Whether an ``Authorization`` value is ``Bearer``, one space and exactly ``token``: the
    scheme in any case (RFC 9110 §11.1), the token compared in constant time."""
    scheme, _, given = authorization.partition(b" ")
    # The token is compared whatever the scheme, so the time does not tell which part was wrong.
    matches = hmac.compare_digest(given, token)
    return scheme.lower() == b"bearer" and matches
