"""The identifier rules (``grpc.md`` §3): bounds in UTF-8 bytes, UUIDs, and the texts of both sides."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codemode.errors import RemoteProtocolError, WireConversionError
from codemode.protocol.grpc import identifiers as ids
from codemode.protocol.grpc.constants import MAX_IDENTIFIER_BYTES

CANONICAL = "3f2b8f8e-4a52-4a8e-9d61-1f1c5e0b8f11"
UUIDS = [
    CANONICAL,
    CANONICAL.upper(),
    CANONICAL.replace("-", ""),
    "{" + CANONICAL + "}",
    "urn:uuid:" + CANONICAL,
    "00000000-0000-0000-0000-000000000000",
]
NOT_UUIDS = [
    "",
    "1",
    "not-a-uuid",
    CANONICAL[:-1],
    CANONICAL + "0",
    CANONICAL.replace("f", "g"),
    " " + CANONICAL,
    CANONICAL + "\n",
    "{" + CANONICAL,
    "urn:uuid:" + CANONICAL.replace("-", ""),
    "3f2b8f8e4a52-4a8e-9d61-1f1c5e0b8f11",
    "3f2b8f8e-4a52-4a8e-9d611f1c-5e0b8f11",
    CANONICAL.replace("a", "\uff41"),  # a full-width letter is no hex digit
]


def test_the_bound_is_256_bytes() -> None:
    assert MAX_IDENTIFIER_BYTES == 256


@pytest.mark.parametrize("value", UUIDS)
def test_uuid_spellings_are_accepted(value: str) -> None:
    assert ids.is_uuid(value)
    assert ids.check_invocation_id(value) == value
    assert ids.check_notification_id(value) == value
    assert ids.check_request_identifier("session_id", value, uuid=True) == value


@pytest.mark.parametrize("value", NOT_UUIDS)
def test_other_texts_are_not_uuids(value: str) -> None:
    assert not ids.is_uuid(value)
    with pytest.raises(RemoteProtocolError) as raised:
        ids.check_invocation_id(value)
    assert str(raised.value) == "code-mode tool invocation ID must be a UUID"
    with pytest.raises(RemoteProtocolError) as raised:
        ids.check_notification_id(value)
    assert str(raised.value) == "code-mode notification ID must be a UUID"


@given(st.uuids())
def test_every_uuid_in_its_usual_spelling_is_accepted(value: uuid.UUID) -> None:
    assert ids.is_uuid(str(value))
    assert ids.is_uuid(value.hex)


@pytest.mark.parametrize("field", ["invocation_id", "notification_id"])
def test_a_host_requires_uuid_invocation_and_notification_ids(field: str) -> None:
    what = {"invocation_id": "tool invocation", "notification_id": "notification"}[field]
    with pytest.raises(WireConversionError) as raised:
        ids.check_request_identifier(field, "a" * 256, uuid=True)
    assert str(raised.value) == f"code-mode {what} ID must be a UUID"


def test_the_canonical_spelling_of_a_uuid() -> None:
    value = uuid.uuid4()
    for spelling in (str(value).upper(), value.hex, f"{{{value}}}", f"urn:uuid:{value}"):
        assert ids.canonical_uuid(spelling) == str(value)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        # Upstream 0.171.0's texts.
        ("", "code-mode session ID must not be empty"),
        ("a" * 257, "code-mode session ID exceeds 256 bytes"),
        ("é" * 129, "code-mode session ID exceeds 256 bytes"),
        ("not-a-uuid", "code-mode session ID must be a UUID"),
        ("a" * 256, "code-mode session ID must be a UUID"),
    ],
)
def test_a_host_refuses_a_malformed_session_id(value: str, text: str) -> None:
    with pytest.raises(WireConversionError) as raised:
        ids.check_request_identifier("session_id", value, uuid=True)
    assert str(raised.value) == text


@pytest.mark.parametrize(
    ("field", "what"),
    [
        ("execution_id", "execution"),
        ("wait_id", "wait"),
        ("tool_call_id", "tool call"),
        ("cell_id", "cell"),
    ],
)
def test_opaque_request_identifiers_are_only_bounded(field: str, what: str) -> None:
    for value in ("1", "not-a-uuid", "a" * 256, "é" * 128, "🙂" * 64, "\ud800" * 85):
        assert ids.check_request_identifier(field, value) == value
    with pytest.raises(WireConversionError) as raised:
        ids.check_request_identifier(field, "")
    assert str(raised.value) == f"code-mode {what} ID must not be empty"
    for value in ("a" * 257, "é" * 128 + "a", "🙂" * 64 + "a", "\ud800" * 86):
        with pytest.raises(WireConversionError) as raised:
            ids.check_request_identifier(field, value)
        assert str(raised.value) == f"code-mode {what} ID exceeds 256 bytes"


@pytest.mark.parametrize("what", ["session ID", "cell ID", "tool call ID", "notification call ID"])
def test_a_client_refuses_empty_or_long_identifiers_from_the_host(what: str) -> None:
    assert ids.check_host_identifier(what, "é" * 128) == "é" * 128
    with pytest.raises(RemoteProtocolError) as raised:
        ids.check_host_identifier(what, "")
    assert str(raised.value) == f"gRPC code-mode host returned an empty {what}"
    with pytest.raises(RemoteProtocolError) as raised:
        ids.check_host_identifier(what, "x" * 257)
    assert str(raised.value) == f"gRPC code-mode host returned {what} exceeding 256 bytes"


def test_the_spec_examples_read_exactly() -> None:
    with pytest.raises(RemoteProtocolError) as raised:
        ids.check_host_identifier("cell ID", "c" * 257)
    assert str(raised.value) == "gRPC code-mode host returned cell ID exceeding 256 bytes"
    with pytest.raises(RemoteProtocolError) as raised:
        ids.check_host_identifier("session ID", "")
    assert str(raised.value) == "gRPC code-mode host returned an empty session ID"


@given(st.text(max_size=100))
def test_byte_length_is_utf8(value: str) -> None:
    assert ids.identifier_bytes(value) == len(value.encode("utf-8", "surrogatepass"))
