"""gRPC over this process's stdin/stdout (``--listen grpc+stdio://``): one HTTP/2 connection.

``grpc.aio`` servers listen on sockets only. So the host listens on a Unix socket in a private
directory (mode 0700), connects to it once, removes the socket's name (nobody else can connect)
and copies bytes between that connection and stdin/stdout. The end of stdin is the end of the
client: the host stops and its sessions close. stdout carries HTTP/2 bytes only (logs go to
stderr). This is how upstream Codex starts its host since 0.171 (``docs/interop.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Final

from codemode.host.grpc import GrpcAddress, GrpcHost, GrpcHostOptions
from codemode.session import CodeModeSessionProvider
from codemode.transports.stream import ByteWriter, stdio_streams

__all__ = ["LISTEN_URL", "serve_grpc_stdio"]

logger = logging.getLogger("codemode.host")

#: The ``--listen`` value (upstream's spelling).
LISTEN_URL: Final = "grpc+stdio://"
_CHUNK: Final = 1 << 16
#: After a graceful shutdown, how long the host's last bytes may take to reach stdout.
_FLUSH_TIMEOUT: Final = 2.0


@dataclass(frozen=True, slots=True)
class _PrivateSocket(GrpcAddress):
    """A Unix socket the host listens on for its one stdio connection."""

    path: str = ""

    def bind_target(self) -> str:
        return f"unix:{self.path}"

    def url(self, port: int | None = None) -> str:
        return LISTEN_URL


async def serve_grpc_stdio(
    provider: CodeModeSessionProvider,
    *,
    options: GrpcHostOptions | None = None,
    stop: asyncio.Event | None = None,
    shutdown_grace: float = 0.0,
) -> None:
    """Serve ``provider`` as ``codex.code_mode.v1.CodeModeHost`` on stdin/stdout until stdin ends
    (the client left: its sessions close) or ``stop`` is set (graceful: running cells get
    ``shutdown_grace`` seconds, then the connection ends)."""
    with tempfile.TemporaryDirectory(prefix="codemode-grpc-stdio-") as directory:
        path = os.path.join(directory, "host.sock")
        host = GrpcHost(provider, _PrivateSocket("localhost", 0, path), options=options)
        await host.start()
        try:
            reader, writer = await asyncio.open_unix_connection(path)
            os.unlink(path)  # the one connection is made: nobody else may connect
            stdin, stdout = await stdio_streams()
            # Whatever prints by mistake must not corrupt the HTTP/2 bytes on stdout.
            sys.stdout = sys.stderr
            inbound = asyncio.ensure_future(_copy(stdin, writer, half_close=True))
            outbound = asyncio.ensure_future(_copy(reader, stdout))
            stopping = asyncio.ensure_future((stop or asyncio.Event()).wait())
            await asyncio.wait((inbound, outbound, stopping), return_when=asyncio.FIRST_COMPLETED)
            if stopping.done():
                logger.info("event=shutting-down grace=%s", shutdown_grace)
                await host.shutdown(shutdown_grace)
                await asyncio.wait((outbound,), timeout=_FLUSH_TIMEOUT)  # the GOAWAY goes out
            elif inbound.done():
                logger.info("event=client-closed listen=%s", LISTEN_URL)
            for task in (inbound, outbound, stopping):
                task.cancel()
            writer.close()
            with contextlib.suppress(Exception):
                await stdout.drain()
        finally:
            await host.aclose()


async def _copy(
    source: asyncio.StreamReader,
    sink: asyncio.StreamWriter | ByteWriter,
    *,
    half_close: bool = False,
) -> None:
    """Copy bytes until ``source`` ends; then half-close ``sink`` (if asked and it can)."""
    with contextlib.suppress(ConnectionError):
        while chunk := await source.read(_CHUNK):
            sink.write(chunk)
            await sink.drain()
        if half_close and isinstance(sink, asyncio.StreamWriter) and sink.can_write_eof():
            sink.write_eof()
