"""Wire message details the vectors do not spell out: error texts and construction rules."""

from __future__ import annotations

from typing import Any

import pytest

from codemode.errors import FrameError
from codemode.protocol.v1 import MessageDecoder
from codemode.protocol.v1.messages import ClientToHost, ConnectionHello, WireRuntimeResponse

CLIENT = MessageDecoder[Any](ClientToHost)


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        (
            b'{"type":"operation/request","id":1,"request":{"method":"session/open","sessionId":" "}}',
            "identifier must not be empty - at `$.request.sessionId`",
        ),
        (
            b'{"type":"connection/hello","supportedVersions":[],"requiredCapabilities":[],"optionalCapabilities":[]}',
            "at least one protocol version is required",
        ),
        (
            b'{"type":"connection/hello","supportedVersions":[1,1],"requiredCapabilities":[],"optionalCapabilities":[]}',
            "duplicate protocol version 1",
        ),
        (
            b'{"type":"connection/hello","supportedVersions":[1],"requiredCapabilities":["a","a"],"optionalCapabilities":[]}',
            "duplicate capability `a`",
        ),
        (
            b'{"type":"connection/hello","supportedVersions":[1],"requiredCapabilities":["a"],"optionalCapabilities":["a"]}',
            "capability `a` cannot be both required and optional",
        ),
        (b'{"type":"operation/cancel","id":1,"id":2}', "duplicate key `id`"),
    ],
)
def test_decode_error_details(text: bytes, detail: str) -> None:
    with pytest.raises(FrameError) as caught:
        CLIENT.decode(text)
    assert str(caught.value).startswith("failed to decode code-mode IPC frame: ")
    assert detail in str(caught.value)


def test_hello_sets_are_sorted_on_construction() -> None:
    hello = ConnectionHello((2, 1), (), ("b", "a"))
    assert hello.supported_versions == (1, 2)
    assert hello.optional_capabilities == ("a", "b")


def test_runtime_response_needs_exactly_one_variant() -> None:
    with pytest.raises(ValueError, match="exactly one key"):
        WireRuntimeResponse()
