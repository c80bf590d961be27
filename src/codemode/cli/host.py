"""``codemode host``: serve the embedded runtime over stdio, WebSocket or gRPC."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from codemode.cli.common import (
    engine_arguments,
    local_provider,
    loop_argument,
    non_negative,
    non_negative_seconds,
    positive,
    run_main,
    wire_revision_argument,
)
from codemode.host import HostOptions, serve_v1_connection
from codemode.host.address import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PING_INTERVAL,
    DEFAULT_PING_TIMEOUT,
    MIN_CLIENT_PING_INTERVAL,
    WebSocketAddress,
    is_loopback,
)
from codemode.protocol.constants import (
    DEFAULT_MAX_ACTIVE_CELLS,
    DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    SHUTDOWN_TIMEOUT,
)
from codemode.runtime.engine import log_confinement
from codemode.runtime.session import (
    DEFAULT_MAX_ENGINES,
    DEFAULT_MAX_HELD_CHARS,
    DEFAULT_TOTAL_MEMORY_CAP_BYTES,
)
from codemode.transports import StreamTransport, stdio_transport

if TYPE_CHECKING:
    from codemode.host.grpc import GrpcHostOptions, GrpcTls

__all__ = ["add_parser"]


def _host_options(args: argparse.Namespace) -> HostOptions:
    return HostOptions(
        max_in_flight_requests=args.max_in_flight_requests,
        max_active_cells=args.max_active_cells,
        wire_revision=args.wire_revision,
    )


async def _host_stdio(args: argparse.Namespace) -> int:
    provider = local_provider(args, store_load=not args.no_store_load)
    log_confinement()
    # Start an engine while the client says hello.
    warming = asyncio.ensure_future(provider.warm())
    try:
        transport = await stdio_transport()
        clean = await serve_v1_connection(transport, provider, _host_options(args))
        # The answers written before stdin ended are the client's even if it reads them late:
        # they leave before the process exits (or it exits non-zero: they were lost).
        clean = await _stdout_flushed(transport, SHUTDOWN_TIMEOUT) and clean
    finally:
        if not warming.done():
            warming.cancel()
        with contextlib.suppress(BaseException):
            await warming
        await provider.aclose()
    return 0 if clean else 1


async def _stdout_flushed(transport: StreamTransport, timeout: float) -> bool:
    """Wait (at most ``timeout``) until what was sent on ``transport`` is written to stdout;
    False, and an error logged, if some of it could not be."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while left := transport.unsent():  # a broken pipe drops what it held: 0
        if loop.time() >= deadline:
            logging.getLogger("codemode.host").error(
                "code-mode host: %d bytes for the client were not written within %.0f s",
                left,
                timeout,
            )
            return False
        await asyncio.sleep(0.01)
    return True


async def _host_websocket(
    args: argparse.Namespace, address: WebSocketAddress, token: str | None
) -> int:
    from codemode.host.websocket import WebSocketHost  # the websockets library: only when used

    provider = local_provider(args, store_load=not args.no_store_load)
    log = logging.getLogger("codemode.host")
    log_confinement()
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
        if listen.startswith("grpc+stdio:"):
            return _host_grpc_stdio_command(args, listen)
        if listen.startswith("grpc://"):
            return _host_grpc_command(args, listen)
        if args.tls_cert is not None or args.tls_key is not None:
            print(
                "codemode host: --tls-cert/--tls-key: not supported yet for --listen "
                f"{'stdio' if listen == 'stdio' else 'ws://'} (only grpc://)",
                file=sys.stderr,
            )
            return 2
        if listen == "stdio":
            return run_main(lambda: _host_stdio(args), args.loop)
        if not listen.startswith("ws://"):
            print(
                f"codemode host: --listen {listen}: expected stdio, ws://ADDR:PORT[/PATH], "
                "grpc://ADDR:PORT or grpc+stdio://",
                file=sys.stderr,
            )
            return 2
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
        return run_main(lambda: _host_websocket(args, address, token), args.loop)
    except KeyboardInterrupt:
        return 130


def _grpc_installed() -> bool:
    """Whether the `grpc` extra is installed (else say how to install it)."""
    try:
        import codemode.host.grpc  # noqa: F401
    except ImportError:
        print(
            "codemode host: gRPC needs the `grpc` extra: pip install 'codemode[grpc]'",
            file=sys.stderr,
        )
        return False
    return True


def _host_grpc_command(args: argparse.Namespace, listen: str) -> int:
    if not _grpc_installed():
        return 2
    from codemode.host.grpc import GrpcAddress, GrpcTls

    try:
        address = GrpcAddress.parse(listen)
        token = _host_token(args)
    except (ValueError, OSError) as error:
        print(f"codemode host: --listen {listen}: {error}", file=sys.stderr)
        return 2
    if (args.tls_cert is None) != (args.tls_key is None):
        print("codemode host: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    tls = None
    if args.tls_cert is not None:
        try:
            tls = GrpcTls.from_files(args.tls_cert, args.tls_key)
        except (ValueError, OSError) as error:
            print(f"codemode host: --tls-cert/--tls-key: {error}", file=sys.stderr)
            return 2
    # TLS alone does not say who may call: a public address still needs a token (as WebSocket).
    if token is None and not is_loopback(address.host) and not args.insecure:
        print(
            f"codemode host: refusing to listen on {address.host} over gRPC without a token: "
            "give --token-file (or $CODEMODE_HOST_TOKEN), or --insecure to serve anyone who can "
            "reach it",
            file=sys.stderr,
        )
        return 2
    return run_main(lambda: _host_grpc(args, listen, token, tls), args.loop)


def _grpc_options(args: argparse.Namespace) -> GrpcHostOptions:
    from codemode.host.grpc import DEFAULT_KEEPALIVE_TIMEOUT, GrpcHostOptions

    return GrpcHostOptions(
        max_active_cells=args.max_active_cells,
        max_in_flight_requests=args.max_in_flight_requests,
        max_sessions=args.max_sessions,
        keepalive_time=args.ping_interval,
        # gRPC has no "never": a timeout of 0 keeps the default.
        keepalive_timeout=args.ping_timeout or DEFAULT_KEEPALIVE_TIMEOUT,
        min_client_ping_interval=args.min_client_ping_interval,
    )


def _host_grpc_stdio_command(args: argparse.Namespace, listen: str) -> int:
    if listen.rstrip("/") != "grpc+stdio:":
        print(f"codemode host: --listen {listen}: expected grpc+stdio://", file=sys.stderr)
        return 2
    if args.tls_cert is not None or args.tls_key is not None or args.token_file is not None:
        print(
            "codemode host: grpc+stdio:// serves the process's own pipes: no --tls-cert, "
            "--tls-key or --token-file",
            file=sys.stderr,
        )
        return 2
    if not _grpc_installed():
        return 2
    return run_main(lambda: _host_grpc(args, listen), args.loop)


async def _host_grpc(
    args: argparse.Namespace,
    listen: str,
    token: str | None = None,
    tls: GrpcTls | None = None,
) -> int:
    """Serve gRPC on ``listen`` (``grpc://…`` or ``grpc+stdio://``) until SIGTERM/SIGINT (or,
    over stdio, the end of stdin)."""
    from codemode.host.grpc import serve_grpc
    from codemode.host.grpc_stdio import serve_grpc_stdio

    provider = local_provider(args, store_load=not args.no_store_load)
    log_confinement()
    warming = asyncio.ensure_future(provider.warm())  # an engine starts while clients connect
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    options = _grpc_options(args)
    try:
        if listen.startswith("grpc+stdio:"):
            await serve_grpc_stdio(
                provider, options=options, stop=stop, shutdown_grace=args.shutdown_grace
            )
        else:
            await serve_grpc(
                provider,
                listen,
                stop=stop,
                options=options,
                shutdown_grace=args.shutdown_grace,
                ready=lambda url: print(url, flush=True),
                token=token,
                tls=tls,
            )
    except OSError as error:
        print(f"codemode host: cannot listen on {listen}: {error}", file=sys.stderr)
        return 1
    finally:
        if not warming.done():
            warming.cancel()
        with contextlib.suppress(BaseException):
            await warming
        await provider.aclose()
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``host`` command."""
    host = commands.add_parser(
        "host",
        help="serve sessions to a remote client over Protocol V1",
        description="Serve the embedded runtime over Protocol V1. With --stdio (or --listen "
        "stdio, the upstream host's spelling), serve exactly one connection on stdin/stdout "
        "(stdout carries frames only; logs go to stderr) and exit when stdin ends: status 0 after "
        "a clean end, 1 after a connection error. With --listen ws://ADDR:PORT[/PATH], serve "
        "WebSocket connections (single, or control + bulk) until SIGTERM/SIGINT; the first line "
        "of stdout is the control URL (PORT 0 picks a free port). A non-loopback address needs "
        "a token (--token-file or $CODEMODE_HOST_TOKEN) unless --insecure. With --listen "
        "grpc://ADDR:PORT, serve the codex.code_mode.v1.CodeModeHost gRPC service the same way, "
        "with the same token rule (the token travels as `authorization: Bearer` metadata; "
        "grpc.health.v1 stays open, like /readyz) and optional TLS (--tls-cert/--tls-key; the "
        "printed URL stays grpc://, clients opt into TLS). Status 2: bad usage.",
    )
    host.add_argument("--stdio", action="store_true", help="serve one connection on stdin/stdout")
    host.add_argument(
        "--listen",
        metavar="ADDRESS",
        help="`stdio` (the same as --stdio), ws://ADDR:PORT[/PATH], grpc://ADDR:PORT or "
        "grpc+stdio:// (gRPC over stdin/stdout, one connection)",
    )
    host.add_argument(
        "--token-file",
        metavar="PATH",
        help="WebSocket and gRPC: require `Authorization: Bearer <the file's content>` on every "
        "socket / rpc",
    )
    host.add_argument(
        "--insecure",
        action="store_true",
        help="WebSocket and gRPC: allow a non-loopback address without a token",
    )
    host.add_argument(
        "--tls-cert",
        metavar="PATH",
        help="gRPC: serve TLS with this PEM certificate chain (with --tls-key; not supported yet "
        "for WebSocket)",
    )
    host.add_argument(
        "--tls-key",
        metavar="PATH",
        help="gRPC: the PEM private key of --tls-cert",
    )
    host.add_argument(
        "--max-connections",
        type=positive,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="WebSocket: connections served at once (more get HTTP 503)",
    )
    host.add_argument(
        "--ping-interval",
        type=non_negative_seconds,
        default=DEFAULT_PING_INTERVAL,
        metavar="SECONDS",
        help="WebSocket and gRPC: keepalive ping period (0: none)",
    )
    host.add_argument(
        "--ping-timeout",
        type=non_negative_seconds,
        default=DEFAULT_PING_TIMEOUT,
        metavar="SECONDS",
        help="WebSocket and gRPC: a connection whose pong takes longer ends, with its sessions "
        "(0: never; gRPC keeps its default then)",
    )
    host.add_argument(
        "--min-client-ping-interval",
        type=non_negative_seconds,
        default=MIN_CLIENT_PING_INTERVAL,
        metavar="SECONDS",
        help="gRPC: how often a client may send its own keepalive pings while it sends nothing "
        "else (more often ends its connection with GOAWAY too_many_pings; 0: any rate)",
    )
    host.add_argument(
        "--max-engines",
        type=non_negative,
        default=DEFAULT_MAX_ENGINES,
        metavar="N",
        help="engine processes at once, over all connections (one per session; at the bound an "
        "idle session's engine is taken back, and a cell that finds every engine busy is refused; "
        "default: 256, or as many idle engines as fit in a quarter of the memory; 0: no bound)",
    )
    host.add_argument(
        "--max-held-chars",
        type=non_negative,
        default=DEFAULT_MAX_HELD_CHARS,
        metavar="N",
        help="characters the cells of all sessions may make the host hold at once: stores, "
        "output not yet observed, tool inputs not yet answered (what would pass it is refused "
        "as at a session's own bounds; default: a quarter of the machine's memory; 0: no bound)",
    )
    host.add_argument(
        "--total-memory-cap",
        type=non_negative,
        default=DEFAULT_TOTAL_MEMORY_CAP_BYTES,
        metavar="BYTES",
        help="resident memory of all engine processes together (past it the one that grew the "
        "most since they were within it is stopped "
        "and its cells end, as at its own --memory-cap; default: half the machine's memory, "
        "never below --memory-cap; 0: no bound)",
    )
    host.add_argument(
        "--max-sessions",
        type=positive,
        default=None,
        metavar="N",
        help="gRPC: open sessions at once (more get RESOURCE_EXHAUSTED; default: no bound)",
    )
    host.add_argument(
        "--shutdown-grace",
        type=non_negative_seconds,
        default=30.0,
        metavar="SECONDS",
        help="ws and grpc: on SIGTERM, how long running cells may go on before they are stopped",
    )
    host.add_argument(
        "--max-in-flight-requests",
        type=positive,
        default=DEFAULT_MAX_IN_FLIGHT_REQUESTS,
        metavar="N",
        help="requests a connection may have unanswered at once (more are refused)",
    )
    host.add_argument(
        "--max-active-cells",
        type=positive,
        default=DEFAULT_MAX_ACTIVE_CELLS,
        metavar="N",
        help="cells a connection may have admitted and not yet closed (more are refused)",
    )
    host.add_argument(
        "--no-store-load", action="store_true", help="cells get no store/load globals"
    )
    host.add_argument("--verbose", action="store_true", help="debug logging on stderr")
    wire_revision_argument(host, "the shape of the runtime responses the host writes", auto=True)
    engine_arguments(host)
    loop_argument(host)
    host.set_defaults(handler=_host_command)
