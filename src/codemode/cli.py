"""The ``codemode`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from codemode.errors import CodeModeError, FrameError
from codemode.protocol.v1 import (
    EOF,
    NEED_DATA,
    WIRE_TYPES,
    FrameDecoder,
    MessageDecoder,
    encode_payload,
)
from codemode.protocol.v1.conversions import execute_request_to_domain, limits_to_domain
from codemode.protocol.v1.messages import (
    ClientToHost,
    HostToClient,
    WireExecuteRequest,
    WireSessionCellExecutionLimits,
)

__all__ = ["main"]

_ANY_MESSAGE = "message"
# Domain types are checked in their wire form plus the domain conversion (§5).
_DOMAIN_TYPES: dict[str, tuple[Any, Callable[[Any], object]]] = {
    "ExecuteRequest": (WireExecuteRequest, execute_request_to_domain),
    "CodeModeSessionCellExecutionLimits": (WireSessionCellExecutionLimits, limits_to_domain),
}
_TYPE_CHOICES = [_ANY_MESSAGE, "json", *WIRE_TYPES, *_DOMAIN_TYPES]
_READ_CHUNK = 1 << 16


def _decoder(type_name: str) -> MessageDecoder[Any]:
    if type_name == "json":
        return MessageDecoder(Any)
    if type_name == _ANY_MESSAGE:
        return MessageDecoder(ClientToHost | HostToClient)
    if type_name in _DOMAIN_TYPES:
        return MessageDecoder(_DOMAIN_TYPES[type_name][0])
    return MessageDecoder(WIRE_TYPES[type_name])


def _wire_validate(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read()
    try:
        message = _decoder(args.type).decode(data)
        if args.type in _DOMAIN_TYPES:
            _DOMAIN_TYPES[args.type][1](message)
    except CodeModeError as error:
        print(error, file=sys.stderr)
        return 1
    sys.stdout.buffer.write(encode_payload(message) + b"\n")
    return 0


def _wire_frames(args: argparse.Namespace) -> int:
    if args.file == "-":
        return _print_frames(sys.stdin.buffer, args.type)
    try:
        with open(args.file, "rb") as stream:
            return _print_frames(stream, args.type)
    except OSError as error:
        print(f"codemode: cannot read {args.file}: {error.strerror}", file=sys.stderr)
        return 1


def _print_frames(stream: BinaryIO, type_name: str) -> int:
    reader: FrameDecoder[Any] = FrameDecoder(_decoder(type_name))
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codemode",
        description="Code Mode protocol tools: run cells, serve hosts, check wire data.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    validate.set_defaults(handler=_wire_validate)
    frames = wire_commands.add_parser(
        "frames",
        help="decode a captured V1 byte stream, one message per line",
        description="Decode length-prefixed V1 frames from FILE (or - for stdin) and print each "
        "validated message as one line of canonical JSON. Errors go to stderr with the byte "
        "offset of the frame; the exit status is 1 if any frame failed.",
    )
    frames.add_argument("file", metavar="FILE", help="capture file, or - for stdin")
    frames.add_argument(
        "--type",
        default=_ANY_MESSAGE,
        choices=_TYPE_CHOICES,
        metavar="TYPE",
        help="validate every frame as TYPE (default: any client or host message)",
    )
    frames.set_defaults(handler=_wire_frames)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    status: int = args.handler(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
