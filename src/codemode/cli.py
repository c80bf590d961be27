"""The ``codemode`` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from codemode.errors import CodeModeError, FrameError
from codemode.host import HostOptions, serve_v1_connection
from codemode.host.websocket import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PING_INTERVAL,
    DEFAULT_PING_TIMEOUT,
    WebSocketAddress,
    WebSocketHost,
    is_loopback,
)
from codemode.model.registry import ToolRegistry
from codemode.model.render import render_response
from codemode.model.toolfile import load_tool_file
from codemode.protocol import (
    CellId,
    ContentItem,
    ExecuteRequest,
    InputImage,
    InputText,
    Result,
    RuntimeResponse,
    Terminated,
    WaitRequest,
    Yielded,
    parse_exec_source,
)
from codemode.protocol.constants import (
    DEFAULT_MAX_ACTIVE_CELLS,
    DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    DEFAULT_WAIT_YIELD_TIME_MS,
)
from codemode.protocol.v1 import (
    EOF,
    NEED_DATA,
    WIRE_TYPES,
    FrameDecoder,
    MessageDecoder,
    WireRevision,
    encode_payload,
)
from codemode.protocol.v1.conversions import (
    execute_request_to_domain,
    limits_to_domain,
    runtime_response_to_wire,
)
from codemode.protocol.v1.messages import (
    ClientToHost,
    HostToClient,
    WireExecuteRequest,
    WireSessionCellExecutionLimits,
)
from codemode.runtime import LocalSessionProvider, confinement, find_node
from codemode.runtime.confinement import LAYERS
from codemode.runtime.engine import DEFAULT_MEMORY_CAP_BYTES
from codemode.runtime.isolated_vm import VERSION as ISOLATED_VM_VERSION
from codemode.runtime.isolated_vm import ensure_isolated_vm
from codemode.transports import stdio_transport

__all__ = ["main"]

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
    except OSError as error:
        print(f"codemode: cannot read {args.file}: {error.strerror}", file=sys.stderr)
        return 1
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


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a positive integer, got 0")
    return value


def _describe_item(item: ContentItem) -> str:
    if isinstance(item, InputText):
        return item.text
    url = item.image_url if isinstance(item, InputImage) else item.audio_url
    kind = "image" if isinstance(item, InputImage) else "audio"
    shown = url if len(url) <= 72 else url[:60] + f"… ({len(url)} chars)"
    detail = f", detail {item.detail.value}" if isinstance(item, InputImage) and item.detail else ""
    return f"[{kind}: {shown}{detail}]"


def _print_rendered(response: RuntimeResponse, seconds: float, max_tokens: int | None) -> None:
    rendered = render_response(response, seconds, max_tokens)
    print("\n".join(_describe_item(item) for item in rendered.items), flush=True)


async def _run(args: argparse.Namespace) -> int:
    if args.file == "-":
        source = sys.stdin.read()
    else:
        try:
            source = Path(args.file).read_text(encoding="utf-8")
        except OSError as error:
            print(f"codemode: cannot read {args.file}: {error.strerror}", file=sys.stderr)
            return 2

    def show_notification(call_id: str, cell_id: CellId, text: str) -> None:
        print(f"notify: {text}", file=sys.stderr, flush=True)

    try:
        parsed = parse_exec_source(source)
        if args.tools:
            registry = load_tool_file(args.tools, on_notify=show_notification)
        else:
            registry = ToolRegistry(on_notify=show_notification)
    except CodeModeError as error:
        print(f"codemode: {error}", file=sys.stderr)
        return 2
    yield_ms = args.yield_ms if args.yield_ms is not None else parsed.yield_time_ms
    max_tokens = args.max_output_tokens
    if max_tokens is None:
        max_tokens = parsed.max_output_tokens
    progress = sys.stderr.isatty() and not args.json
    started_at = time.monotonic()
    collected: list[ContentItem] = []
    async with _provider(args) as provider:
        session = await provider.create_session(registry)
        cell = await session.execute(
            ExecuteRequest(
                tool_call_id="run-1",
                source=parsed.code,
                enabled_tools=registry.definitions(),
                yield_time_ms=yield_ms,
                max_output_tokens=max_tokens,
            )
        )
        response = await cell.initial_response()
        observed_at = started_at
        while True:
            now = time.monotonic()
            collected.extend(response.content_items)
            if not args.json and (response.content_items or not isinstance(response, Yielded)):
                _print_rendered(response, now - observed_at, max_tokens)
            elif progress:
                print(
                    f"… cell {cell.cell_id} still running ({now - started_at:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            if not isinstance(response, Yielded):
                break
            observed_at = now
            outcome = await session.wait(
                WaitRequest(
                    cell.cell_id, DEFAULT_WAIT_YIELD_TIME_MS if yield_ms is None else yield_ms
                )
            )
            response = outcome.response
    if args.json:
        final: RuntimeResponse
        if isinstance(response, Result):
            final = Result(response.cell_id, collected, response.error_text)
        else:
            final = Terminated(response.cell_id, collected)
        sys.stdout.buffer.write(encode_payload(runtime_response_to_wire(final)) + b"\n")
        sys.stdout.flush()
    failed = isinstance(response, Result) and response.error_text is not None
    return 1 if failed else 0


def _provider(args: argparse.Namespace, *, store_load: bool = True) -> LocalSessionProvider:
    return LocalSessionProvider(
        store_load=store_load,
        shared_engine=args.shared_engine,
        memory_cap_bytes=args.memory_cap,
        require_confinement=args.require_confinement,
    )


def _doctor_command(args: argparse.Namespace) -> int:
    """Print what the engine needs and which confinement layers apply here."""
    report = confinement.probe()
    node = find_node()
    print(f"node: {node}")
    try:
        addon = ensure_isolated_vm(node)
    except CodeModeError as error:
        print(f"isolated-vm {ISOLATED_VM_VERSION}: MISSING ({error})")
        return 1
    print(f"isolated-vm {ISOLATED_VM_VERSION}: {addon}")
    print(report.describe())
    for layer in LAYERS:
        print(f"  {layer}: {'active' if layer in report.active() else 'MISSING'}")
    if args.require_confinement and report.missing():
        print("codemode: required confinement layers are missing", file=sys.stderr)
        return 1
    return 0


def _run_command(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except CodeModeError as error:
        print(f"codemode: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _host_options(args: argparse.Namespace) -> HostOptions:
    return HostOptions(
        max_in_flight_requests=args.max_in_flight_requests,
        max_active_cells=args.max_active_cells,
        wire_revision=args.wire_revision,
    )


async def _host_stdio(args: argparse.Namespace) -> int:
    provider = _provider(args, store_load=not args.no_store_load)
    logging.getLogger("codemode.host").info("%s", confinement.probe().describe())
    # Start an engine while the client says hello.
    warming = asyncio.ensure_future(provider.warm())
    try:
        transport = await stdio_transport()
        clean = await serve_v1_connection(transport, provider, _host_options(args))
    finally:
        if not warming.done():
            warming.cancel()
        with contextlib.suppress(BaseException):
            await warming
        await provider.aclose()
    return 0 if clean else 1


async def _host_websocket(
    args: argparse.Namespace, address: WebSocketAddress, token: str | None
) -> int:
    provider = _provider(args, store_load=not args.no_store_load)
    log = logging.getLogger("codemode.host")
    log.info("%s", confinement.probe().describe())
    host = WebSocketHost(
        provider,
        address,
        options=_host_options(args),
        token=token,
        max_connections=args.max_connections,
        ping_interval=args.ping_interval or None,
        ping_timeout=args.ping_timeout or None,
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        try:
            url = await host.start()
        except OSError as error:
            print(f"codemode host: cannot listen on {address.url()}: {error}", file=sys.stderr)
            return 1
        print(url, flush=True)
        log.info("event=listening url=%s auth=%s", url, "token" if token else "none")
        await stop.wait()
        log.info("event=shutting-down grace=%s", args.shutdown_grace)
        await host.shutdown(args.shutdown_grace)
    finally:
        await host.aclose()
        await provider.aclose()
    return 0


def _host_token(args: argparse.Namespace) -> str | None:
    """The bearer token from ``--token-file`` or ``$CODEMODE_HOST_TOKEN``."""
    if args.token_file is not None:
        token = Path(args.token_file).read_text().strip()
        if not token:
            raise ValueError(f"{args.token_file} is empty")
        return token
    return os.environ.get("CODEMODE_HOST_TOKEN") or None


def _host_command(args: argparse.Namespace) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="codemode host: %(levelname)s %(message)s",
    )
    if not args.verbose:  # the listener logs each connection in one structured line already
        logging.getLogger("codemode.host.websocket").setLevel(logging.WARNING)
    listen = "stdio" if args.stdio else args.listen
    if listen is None:
        print("codemode host: --stdio or --listen ADDRESS is required", file=sys.stderr)
        return 2
    try:
        if listen == "stdio":
            return asyncio.run(_host_stdio(args))
        try:
            address = WebSocketAddress.parse(listen)
            token = _host_token(args)
        except (ValueError, OSError) as error:
            print(f"codemode host: --listen {listen}: {error}", file=sys.stderr)
            return 2
        if token is None and not is_loopback(address.host) and not args.insecure:
            print(
                f"codemode host: refusing to listen on {address.host} without a token: give "
                "--token-file (or $CODEMODE_HOST_TOKEN), or --insecure to serve anyone who "
                "can reach it",
                file=sys.stderr,
            )
            return 2
        return asyncio.run(_host_websocket(args, address, token))
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codemode",
        description="Code Mode protocol tools: run cells, serve hosts, check wire data.",
    )
    parser.add_argument("--version", action="version", version=f"codemode {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run one JavaScript cell on the embedded runtime",
        description="Run FILE (or - for stdin) as one code-mode cell, exactly as the exec tool "
        "would: a first-line `// @exec: {...}` pragma is honoured, the cell can call the tools "
        "of --tools, and a cell that yields is waited on until it completes. Prints what the "
        "model would see; --json prints the final RuntimeResponse (all items of the run) as one "
        "line of V1 wire JSON. Exit status: 0 completed, 1 script error, 2 usage error.",
    )
    run.add_argument("file", metavar="FILE", help="JavaScript source file, or - for stdin")
    run.add_argument(
        "--tools",
        metavar="PATH.py",
        help="Python file whose public top-level functions (sync or async) become tools",
    )
    run.add_argument(
        "--yield-ms", type=_non_negative, metavar="N", help="yield time of each observation"
    )
    run.add_argument(
        "--max-output-tokens", type=_non_negative, metavar="N", help="output budget per observation"
    )
    run.add_argument("--json", action="store_true", help="print the final response as wire JSON")
    _engine_arguments(run)
    run.set_defaults(handler=_run_command)

    host = commands.add_parser(
        "host",
        help="serve sessions to a remote client over Protocol V1",
        description="Serve the embedded runtime over Protocol V1. With --stdio (or --listen "
        "stdio, the upstream host's spelling), serve exactly one connection on stdin/stdout "
        "(stdout carries frames only; logs go to stderr) and exit when stdin ends: status 0 after "
        "a clean end, 1 after a connection error. With --listen ws://ADDR:PORT[/PATH], serve "
        "WebSocket connections (single, or control + bulk) until SIGTERM/SIGINT; the first line "
        "of stdout is the control URL (PORT 0 picks a free port). A non-loopback address needs "
        "a token (--token-file or $CODEMODE_HOST_TOKEN) unless --insecure. Status 2: bad usage.",
    )
    host.add_argument("--stdio", action="store_true", help="serve one connection on stdin/stdout")
    host.add_argument(
        "--listen",
        metavar="ADDRESS",
        help="`stdio` (the same as --stdio) or ws://ADDR:PORT[/PATH]",
    )
    host.add_argument(
        "--token-file",
        metavar="PATH",
        help="WebSocket: require `Authorization: Bearer <the file's content>` on every socket",
    )
    host.add_argument(
        "--insecure",
        action="store_true",
        help="WebSocket: allow a non-loopback address without a token",
    )
    host.add_argument(
        "--max-connections",
        type=_positive,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="WebSocket: connections served at once (more get HTTP 503)",
    )
    host.add_argument(
        "--ping-interval",
        type=float,
        default=DEFAULT_PING_INTERVAL,
        metavar="SECONDS",
        help="WebSocket: keepalive ping period (0: none)",
    )
    host.add_argument(
        "--ping-timeout",
        type=float,
        default=DEFAULT_PING_TIMEOUT,
        metavar="SECONDS",
        help="WebSocket: a connection whose pong takes longer ends, with its sessions (0: never)",
    )
    host.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="WebSocket: on SIGTERM, how long running cells may go on before they are stopped",
    )
    host.add_argument(
        "--max-in-flight-requests",
        type=_positive,
        default=DEFAULT_MAX_IN_FLIGHT_REQUESTS,
        metavar="N",
    )
    host.add_argument(
        "--max-active-cells", type=_positive, default=DEFAULT_MAX_ACTIVE_CELLS, metavar="N"
    )
    host.add_argument(
        "--no-store-load", action="store_true", help="cells get no store/load globals"
    )
    host.add_argument("--verbose", action="store_true", help="debug logging on stderr")
    _wire_revision_argument(host, "the shape of the runtime responses the host writes")
    _engine_arguments(host)
    host.set_defaults(handler=_host_command)

    doctor = commands.add_parser(
        "doctor",
        help="check the engine set-up and which confinement layers apply here",
        description="Find Node.js, fetch the pinned isolated-vm addon if it is not cached yet, "
        "and list the engine confinement layers this machine applies. Exit 1 if the engine "
        "cannot start, or (with --require-confinement) if a layer is missing.",
    )
    doctor.add_argument(
        "--require-confinement", action="store_true", help="fail if any layer is missing"
    )
    doctor.set_defaults(handler=_doctor_command)

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
    _wire_revision_argument(validate, "the runtime response shape to accept")
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
    _wire_revision_argument(frames, "the runtime response shape to accept")
    frames.set_defaults(handler=_wire_frames)
    return parser


def _wire_revision_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--wire-revision",
        type=WireRevision,
        choices=list(WireRevision),
        default=WireRevision.PINNED,
        metavar="{" + ",".join(WireRevision) + "}",
        help=f"{what}: pinned (V1 as pinned, the default) or latest (upstream 0.164+: "
        "runtime responses carry code_mode_host_duration_ns and result_buffered_for_ns)",
    )


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-cap",
        type=_positive,
        default=DEFAULT_MEMORY_CAP_BYTES,
        metavar="BYTES",
        help="resident-memory cap of each session's engine process (past it, its cells end)",
    )
    parser.add_argument(
        "--require-confinement",
        action="store_true",
        help="refuse to run cells where an OS confinement layer is unavailable",
    )
    parser.add_argument(
        "--shared-engine",
        action="store_true",
        help="run all sessions in one engine process (one trust domain)",
    )


def _version() -> str:
    try:
        return importlib.metadata.version("codemode")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        from codemode import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.handler(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`codemode wire frames capture.bin | head`): not an error of ours.
        # Point stdout at /dev/null so that the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
