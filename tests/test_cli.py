"""The ``codemode`` command line, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from codemode.protocol.v1 import encode_frame


def codemode(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "codemode", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
    )


def test_wire_validate_prints_the_canonical_encoding() -> None:
    hello = (
        b'{ "optionalCapabilities": ["b", "a"], "type": "connection/hello",'
        b' "supportedVersions": [1], "requiredCapabilities": [] }'
    )
    result = codemode("wire", "validate", "--type", "ClientToHost", stdin=hello)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        b'{"type":"connection/hello","supportedVersions":[1],'
        b'"requiredCapabilities":[],"optionalCapabilities":["a","b"]}\n'
    )


def test_wire_validate_reports_the_error() -> None:
    result = codemode(
        "wire",
        "validate",
        "--type",
        "ClientToHost",
        stdin=b'{"type":"operation/cancel","id":1,"x":1}',
    )
    assert result.returncode == 1
    assert result.stdout == b""
    assert b"unknown field `x`" in result.stderr


def test_wire_validate_domain_type_applies_the_conversion() -> None:
    request = (
        b'{"tool_call_id":"c","enabled_tools":[],"source":"x",'
        b'"yield_time_ms":null,"max_output_tokens":-1}'
    )
    result = codemode("wire", "validate", "--type", "ExecuteRequest", stdin=request)
    assert result.returncode == 1
    assert result.stderr.strip() == b"out of range integral type conversion attempted"
    result = codemode("wire", "validate", "--type", "WireExecuteRequest", stdin=request)
    assert result.returncode == 0


def test_wire_validate_unknown_type_is_a_usage_error() -> None:
    assert codemode("wire", "validate", "--type", "Nope").returncode == 2


def test_wire_frames_prints_messages_and_the_first_framing_error(tmp_path: Path) -> None:
    capture = tmp_path / "capture.bin"
    first = bytes(encode_frame({"type": "operation/cancel", "id": 1}))
    second = bytes(encode_frame({"type": "delegate/cancel", "id": 2}))
    capture.write_bytes(first + b"\x03\x00\x00\x00abc" + second + b"\x01\x00")
    result = codemode("wire", "frames", str(capture))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        b'{"type":"operation/cancel","id":1}',
        b'{"type":"delegate/cancel","id":2}',
    ]
    errors = result.stderr.decode().splitlines()
    assert errors[0].startswith(f"frame at byte offset {len(first)}: failed to decode")
    offset = len(first) + 7 + len(second)
    assert errors[1] == (
        f"frame at byte offset {offset}: code-mode IPC frame length prefix truncated after 2 bytes"
    )


def test_wire_frames_reads_stdin() -> None:
    data = bytes(encode_frame({"type": "cell/closed", "sessionId": "s", "cellId": "1"}))
    result = codemode("wire", "frames", "-", stdin=data)
    assert result.returncode == 0
    assert result.stdout == b'{"type":"cell/closed","sessionId":"s","cellId":"1"}\n'
