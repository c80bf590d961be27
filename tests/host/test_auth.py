"""The bearer-token check of the network listeners (``Authorization: Bearer <token>``)."""

from __future__ import annotations

import pytest

from codemode.host.auth import bearer_token_matches

TOKEN = b"s3cret-Token"


@pytest.mark.parametrize("scheme", [b"Bearer", b"bearer", b"BEARER", b"bEaReR"])
def test_the_scheme_is_taken_in_any_case(scheme: bytes) -> None:
    # RFC 9110 §11.1: the authentication scheme is case-insensitive.
    assert bearer_token_matches(scheme + b" " + TOKEN, TOKEN)


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"Bearer",
        b"Bearer ",
        TOKEN,
        b"Bearer" + TOKEN,
        b"Basic " + TOKEN,
        b"Bearerx " + TOKEN,
        b"Bearer s3cret-token",  # the token itself stays exact
        b"Bearer " + TOKEN + b"x",
        b"Bearer " + TOKEN[:-1],
        b"Bearer " + TOKEN + b" ",
        "Bearer".upper().replace("E", "\u0117").encode() + b" " + TOKEN,  # no Unicode folding
    ],
)
def test_anything_else_is_refused(value: bytes) -> None:
    assert not bearer_token_matches(value, TOKEN)
