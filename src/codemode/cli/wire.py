"""``codemode wire``: validate Protocol V1 messages and decode frame captures."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

from codemode.cli.common import wire_revision_argument
from codemode.errors import CodeModeError, FrameError
from codemode.protocol.v1 import (
    EOF,
    NEED_DATA,
    WIRE_TYPES,
    FrameDecoder,
    MessageDecoder,
    WireRevision,
    encode_payload,
)
from codemode.protocol.v1.conversions import execute_request_to_domain, limits_to_domain
from codemode.protocol.v1.messages import (
    ClientToHost,
    HostToClient,
    WireExecuteRequest,
    WireSessionCellExecutionLimits,
)

__all__ = ["add_parser"]


_ANY_MESSAGE = "message"
# Domain types are checked in their wire form plus the domain conversion (§5).
_DOMAIN_TYPES: dict[str, tuple[Any, Callable[[Any], object]]] = {
    "ExecuteRequest": (WireExecuteRequest, execute_request_to_domain),
    "CodeModeSessionCellExecutionLimits": (WireSessionCellExecutionLimits, limits_to_domain),
}
_TYPE_CHOICES = [_ANY_MESSAGE, "json", *WIRE_TYPES, *_DOMAIN_TYPES]
_READ_CHUNK = 1 << 16


def _decoder(type_name: str, revision: WireRevision = WireRevision.PINNED) -> MessageDecoder[Any]:
    if type_name == "json":
        return MessageDecoder(Any)
    if type_name == _ANY_MESSAGE:
        return MessageDecoder(ClientToHost | HostToClient, revision)
    if type_name in _DOMAIN_TYPES:
        return MessageDecoder(_DOMAIN_TYPES[type_name][0], revision)
    return MessageDecoder(WIRE_TYPES[type_name], revision)


def _wire_validate(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read()
    try:
        message = _decoder(args.type, args.wire_revision).decode(data)
        if args.type in _DOMAIN_TYPES:
            _DOMAIN_TYPES[args.type][1](message)
    except CodeModeError as error:
        print(error, file=sys.stderr)
        return 1
    sys.stdout.buffer.write(encode_payload(message) + b"\n")
    return 0


def _wire_frames(args: argparse.Namespace) -> int:
    if args.file == "-":
        return _print_frames(sys.stdin.buffer, args.type, args.wire_revision)
    try:
        stream = open(args.file, "rb")  # noqa: SIM115 - closed below; read errors stay apart
    except OSError as error:  # a usage error, as `codemode run` reports a FILE it cannot read
        print(f"codemode: cannot read {args.file}: {error.strerror}", file=sys.stderr)
        return 2
    with stream:
        return _print_frames(stream, args.type, args.wire_revision)


def _print_frames(stream: BinaryIO, type_name: str, revision: WireRevision) -> int:
    reader: FrameDecoder[Any] = FrameDecoder(_decoder(type_name, revision))
    out = sys.stdout.buffer
    status = 0
    while True:
        offset = reader.consumed
        try:
            message = reader.next_message()
        except FrameError as error:
            print(f"frame at byte offset {offset}: {error}", file=sys.stderr)
            status = 1
            if not error.stream_usable:
                return status
            continue
        if message is NEED_DATA:
            chunk = stream.read(_READ_CHUNK)
            if chunk:
                reader.receive_data(chunk)
            else:
                reader.receive_eof()
        elif message is EOF:
            return status
        else:
            out.write(encode_payload(message) + b"\n")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``wire`` command."""
    wire = commands.add_parser("wire", help="validate Protocol V1 messages and frame captures")
    wire_commands = wire.add_subparsers(dest="wire_command", required=True, metavar="WIRE_COMMAND")
    validate = wire_commands.add_parser(
        "validate",
        help="check one JSON document on stdin; print its canonical encoding",
        description="Read one JSON document from stdin and validate it as TYPE. On success print "
        "the canonical compact encoding and exit 0; on failure print the error and exit 1.",
    )
    validate.add_argument(
        "--type",
        required=True,
        choices=_TYPE_CHOICES,
        metavar="TYPE",
        help=f"a wire type name ({', '.join(_TYPE_CHOICES)})",
    )
    wire_revision_argument(validate, "the runtime response shape to accept")
    validate.set_defaults(handler=_wire_validate)
    frames = wire_commands.add_parser(
        "frames",
        help="decode a captured V1 byte stream, one message per line",
        description="Decode length-prefixed V1 frames from FILE (or - for stdin) and print each "
        "validated message as one line of canonical JSON. Errors go to stderr with the byte "
        "offset of the frame; the exit status is 1 if any frame failed, 2 if FILE cannot be "
        "read.",
    )
    frames.add_argument("file", metavar="FILE", help="capture file, or - for stdin")
    frames.add_argument(
        "--type",
        default=_ANY_MESSAGE,
        choices=_TYPE_CHOICES,
        metavar="TYPE",
        help="validate every frame as TYPE (default: any client or host message)",
    )
    wire_revision_argument(frames, "the runtime response shape to accept")
    frames.set_defaults(handler=_wire_frames)
