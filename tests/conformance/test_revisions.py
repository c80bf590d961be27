"""Wire revisions (decision 0007): ``latest-roundtrip.json`` and ``latest-reject.json``.

The two files use the formats of ``v1-roundtrip.json`` and ``v1-reject.json`` but are this
project's own: the latest shape (upstream 0.164+, checked against 0.171.0) is not part of the
pinned specification. Every latest vector that holds a runtime response is also rejected by a
pinned decoder (the pinned vectors themselves run unchanged in ``test_messages.py``), and every
pinned vector is accepted by a latest decoder unless it holds a runtime response.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from codemode.errors import FrameError, FrameErrorKind
from codemode.protocol.v1 import WIRE_TYPES, MessageDecoder, WireRevision, encode_payload
from tests.conformance.vectors import canonical, load, params

LATEST = {name: MessageDecoder[Any](t, WireRevision.LATEST) for name, t in WIRE_TYPES.items()}
PINNED = {name: MessageDecoder[Any](t, WireRevision.PINNED) for name, t in WIRE_TYPES.items()}
TIMING = ("code_mode_host_duration_ns", "result_buffered_for_ns")


def _text(entry: dict[str, Any]) -> bytes:
    return json.dumps(entry["json"], ensure_ascii=False).encode("utf-8")


def _has_timing(value: Any) -> bool:
    if isinstance(value, dict):
        return any(key in TIMING or _has_timing(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_has_timing(item) for item in value)
    return False


def _holds_runtime_response(value: Any) -> bool:
    if isinstance(value, dict):
        if len(value) == 1 and next(iter(value)) in ("Yielded", "Terminated", "Result"):
            return True
        return any(_holds_runtime_response(item) for item in value.values())
    if isinstance(value, list):
        return any(_holds_runtime_response(item) for item in value)
    return False


@pytest.mark.parametrize("entry", params("latest-roundtrip.json"))
def test_latest_roundtrip(entry: dict[str, Any]) -> None:
    decoder = LATEST[entry["type"]]
    message = decoder.decode(_text(entry))
    expected = entry.get("canonical", entry["json"])
    encoded = encode_payload(message)
    assert encoded == canonical(expected)
    assert decoder.decode(encoded) == message


@pytest.mark.parametrize("entry", params("latest-roundtrip.json"))
def test_pinned_rejects_the_latest_shape(entry: dict[str, Any]) -> None:
    decoder = PINNED[entry["type"]]
    if not _has_timing(entry["json"]):
        assert encode_payload(decoder.decode(_text(entry))) == canonical(entry["json"])
        return
    with pytest.raises(FrameError) as caught:
        decoder.decode(_text(entry))
    assert caught.value.kind is FrameErrorKind.INVALID_MESSAGE
    assert "Object contains unknown field `" in str(caught.value)


@pytest.mark.parametrize("entry", params("latest-reject.json"))
def test_latest_reject(entry: dict[str, Any]) -> None:
    with pytest.raises(FrameError) as caught:
        LATEST[entry["type"]].decode(_text(entry))
    assert caught.value.kind is FrameErrorKind.INVALID_MESSAGE
    assert str(caught.value).startswith("failed to decode code-mode IPC frame: ")


def test_pinned_vectors_under_latest() -> None:
    """Latest accepts every pinned message without a runtime response, and no pinned runtime
    response (which lacks the required timing fields)."""
    accepted = rejected = 0
    for entry in load("v1-roundtrip.json"):
        if not _holds_runtime_response(entry["json"]):
            message = LATEST[entry["type"]].decode(_text(entry))
            assert message == PINNED[entry["type"]].decode(_text(entry)), entry["name"]
            accepted += 1
            continue
        with pytest.raises(FrameError, match="Object missing required field `") as caught:
            LATEST[entry["type"]].decode(_text(entry))
        assert any(f"`{name}`" in str(caught.value) for name in TIMING), entry["name"]
        rejected += 1
    assert accepted > 50 and rejected >= 5


def test_error_texts_name_the_field_and_place() -> None:
    pinned = b'{"type":"execute/initialResponse","id":2,"result":{"status":"ok","value":{"Yielded":{"cell_id":"1","content_items":[],"code_mode_host_duration_ns":3}}}}'
    with pytest.raises(FrameError) as caught:
        PINNED["HostToClient"].decode(pinned)
    assert str(caught.value) == (
        "failed to decode code-mode IPC frame: Object contains unknown field "
        "`code_mode_host_duration_ns` - at `$.result.value.Yielded`"
    )
    latest = b'{"type":"operation/response","id":4,"result":{"status":"ok","value":{"type":"wait/completed","outcome":{"MissingCell":{"Result":{"cell_id":"9","content_items":[],"error_text":null,"code_mode_host_duration_ns":3}}}}}}'
    with pytest.raises(FrameError) as caught:
        LATEST["HostToClient"].decode(latest)
    assert str(caught.value) == (
        "failed to decode code-mode IPC frame: Object missing required field "
        "`result_buffered_for_ns` - at `$.result.value.outcome.MissingCell.Result`"
    )


def test_default_decoder_is_pinned() -> None:
    assert MessageDecoder(WIRE_TYPES["HostToClient"]).revision is WireRevision.PINNED
    assert WireRevision("latest") is WireRevision.LATEST


@pytest.mark.slow
def test_large_payloads_are_checked_too() -> None:
    """Payloads past the large-payload threshold take another decoding path."""
    text = "x" * (1 << 21)
    body = {"cell_id": "1", "content_items": [{"type": "input_text", "text": text}]}
    pinned = json.dumps({"Yielded": body}).encode()
    latest = json.dumps({"Yielded": {**body, "code_mode_host_duration_ns": 1}}).encode()
    assert LATEST["WireRuntimeResponse"].decode(latest).body.code_mode_host_duration_ns == 1
    assert PINNED["WireRuntimeResponse"].decode(pinned).body.content_items[0].text == text
    for decoder, payload in ((LATEST, pinned), (PINNED, latest)):
        with pytest.raises(FrameError) as caught:
            decoder["WireRuntimeResponse"].decode(payload)
        assert caught.value.kind is FrameErrorKind.INVALID_MESSAGE
