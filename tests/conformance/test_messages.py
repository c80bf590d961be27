"""``v1-roundtrip.json`` and ``v1-reject.json``: every message shape and every strictness rule."""

from __future__ import annotations

import json
from typing import Any

import pytest

from codemode.errors import FrameError, FrameErrorKind
from codemode.protocol.v1 import WIRE_TYPES, MessageDecoder, encode_payload
from tests.conformance.vectors import canonical, params

DECODERS = {name: MessageDecoder[Any](wire_type) for name, wire_type in WIRE_TYPES.items()}


@pytest.mark.parametrize("entry", params("v1-roundtrip.json"))
def test_roundtrip(entry: dict[str, Any]) -> None:
    decoder = DECODERS[entry["type"]]
    text = json.dumps(entry["json"], ensure_ascii=False).encode("utf-8")
    message = decoder.decode(text)
    expected = entry.get("canonical", entry["json"])
    encoded = encode_payload(message)
    assert json.loads(encoded) == expected
    assert encoded == canonical(expected)
    # Decoding the canonical form gives the same message back.
    assert decoder.decode(encoded) == message


@pytest.mark.parametrize("entry", params("v1-reject.json"))
def test_reject(entry: dict[str, Any]) -> None:
    decoder = DECODERS[entry["type"]]
    if "raw" in entry:
        text = entry["raw"].encode("utf-8", "surrogatepass")
    else:
        text = json.dumps(entry["json"], ensure_ascii=False).encode("utf-8")
    with pytest.raises(FrameError) as caught:
        decoder.decode(text)
    assert caught.value.kind in (FrameErrorKind.INVALID_JSON, FrameErrorKind.INVALID_MESSAGE)
    assert str(caught.value).startswith("failed to decode code-mode IPC frame: ")


@pytest.mark.parametrize("entry", params("v1-reject.json"))
def test_reject_json_level_kind(entry: dict[str, Any]) -> None:
    """Text that is not strict JSON is ``invalid_json``; valid JSON is never ``invalid_json``."""
    decoder = DECODERS[entry["type"]]
    if "raw" in entry:
        text = entry["raw"].encode("utf-8", "surrogatepass")
        json_level = True
    else:
        text = json.dumps(entry["json"], ensure_ascii=False).encode("utf-8")
        json_level = False
    with pytest.raises(FrameError) as caught:
        decoder.decode(text)
    expected = FrameErrorKind.INVALID_JSON if json_level else FrameErrorKind.INVALID_MESSAGE
    assert caught.value.kind is expected
