"""Handshake negotiation (§3.3) and the client's checks of the reply (§3.4)."""

from __future__ import annotations

import pytest

from codemode.errors import CodeModeError
from codemode.protocol.constants import DUAL_WEBSOCKET_CAPABILITY as DUAL
from codemode.protocol.constants import SESSION_RESOURCE_LIMITS_CAPABILITY as LIMITS
from codemode.protocol.v1.handshake import check_handshake_reply, client_hello, negotiate
from codemode.protocol.v1.messages import (
    UNSET,
    ConnectionHello,
    ConnectionReady,
    ConnectionRejected,
    InvalidHello,
    MissingRequiredCapability,
    NoCompatibleVersion,
    OperationCancel,
)


def test_client_hello() -> None:
    assert client_hello() == ConnectionHello((1,), (), (LIMITS,))
    assert client_hello(dual_websocket=True) == ConnectionHello((1,), (), (DUAL, LIMITS))


def test_first_message_must_be_hello() -> None:
    reply, granted = negotiate(OperationCancel(1), [LIMITS])
    assert reply == ConnectionRejected(InvalidHello("first message must be connection/hello"))
    assert granted is None


def test_version_is_checked_before_capabilities() -> None:
    reply, _ = negotiate(ConnectionHello((2, 3), ("unknown",), ()), [LIMITS])
    assert reply == ConnectionRejected(NoCompatibleVersion((1,)))


def test_first_missing_required_capability_in_order() -> None:
    hello = ConnectionHello((1, 2), ("zeta", LIMITS, "alpha"), ())
    reply, _ = negotiate(hello, [LIMITS])
    assert reply == ConnectionRejected(MissingRequiredCapability("alpha"))


def test_grant_is_the_supported_subset_with_a_token_only_for_dual() -> None:
    hello = ConnectionHello((1,), (LIMITS,), (DUAL, "unknown"))
    reply, granted = negotiate(hello, [LIMITS])
    assert reply == ConnectionReady(1, (LIMITS,), UNSET)
    assert granted is not None
    assert granted.resource_limits
    assert not granted.dual_websocket

    reply, granted = negotiate(hello, [LIMITS, DUAL], new_token=lambda: "tok")
    assert reply == ConnectionReady(1, (DUAL, LIMITS), "tok")
    assert granted is not None
    assert granted.bulk_connection_token == "tok"


def test_default_tokens_are_random_and_url_safe() -> None:
    hello = client_hello(dual_websocket=True)
    tokens = set()
    for _ in range(20):
        reply, _ = negotiate(hello, [DUAL])
        assert isinstance(reply, ConnectionReady)
        token = reply.bulk_connection_token
        assert isinstance(token, str)
        assert len(token) >= 22
        assert all(c.isalnum() or c in "-_" for c in token)
        tokens.add(token)
    assert len(tokens) == 20


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (
            ConnectionRejected(NoCompatibleVersion((2, 1))),
            "code-mode host rejected the handshake: no compatible protocol version (host supports 1, 2)",
        ),
        (
            ConnectionRejected(MissingRequiredCapability("x")),
            "code-mode host rejected the handshake: missing required capability `x`",
        ),
        (
            ConnectionRejected(InvalidHello("nope")),
            "code-mode host rejected the handshake: invalid hello: nope",
        ),
    ],
)
def test_rejections_are_displayed(reply: ConnectionRejected, message: str) -> None:
    with pytest.raises(CodeModeError) as caught:
        check_handshake_reply(client_hello(), reply)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    "reply",
    [
        OperationCancel(1),
        ConnectionReady(2, ()),
        ConnectionReady(1, ("unrequested",)),
        ConnectionReady(1, (DUAL,)),
        ConnectionReady(1, (), "token-without-dual"),
    ],
)
def test_invalid_replies(reply: object) -> None:
    hello = client_hello(dual_websocket=True)
    with pytest.raises(CodeModeError) as caught:
        check_handshake_reply(hello, reply)  # type: ignore[arg-type]
    assert str(caught.value).startswith("code-mode host returned an invalid handshake response: ")


def test_missing_required_capability_in_ready() -> None:
    hello = ConnectionHello((1,), ("needed",), ())
    with pytest.raises(CodeModeError, match="did not grant required capability"):
        check_handshake_reply(hello, ConnectionReady(1, ()))


def test_valid_reply() -> None:
    granted = check_handshake_reply(
        client_hello(dual_websocket=True), ConnectionReady(1, (DUAL,), "t")
    )
    assert granted.dual_websocket
    assert granted.bulk_connection_token == "t"
