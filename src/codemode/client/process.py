"""Sessions on a host child process over stdio (``protocol-v1.md`` §7.1, §9.1, §9.8).

:class:`ProcessOwnedCodeModeSessionProvider` spawns ``codemode host --stdio`` lazily, shares that
one process among every session it creates, and replaces it with a fresh one when its connection
has died (dead sessions are never revived). The child runs in its own process group, its stderr is
logged line by line at debug level, and it is killed and reaped when its connection fails or the
provider closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Final

from codemode.client.provider import SharedConnectionProvider
from codemode.client.v1 import RemoteSession, V1ClientConnection
from codemode.errors import CodeModeError
from codemode.protocol.constants import HANDSHAKE_TIMEOUT, SHUTDOWN_TIMEOUT
from codemode.protocol.deadlines import DEFAULT_RESPONSE_TIMEOUT
from codemode.protocol.options import checked_seconds
from codemode.protocol.texts import host_spawn_failed
from codemode.protocol.v1.revision import WireRevision
from codemode.spawning import child_preexec
from codemode.transports.stream import StreamTransport, pipe_transport

__all__ = ["DEFAULT_HOST_COMMAND", "HostProcess", "ProcessOwnedCodeModeSessionProvider"]

logger = logging.getLogger("codemode.client.process")

#: ``python -m codemode host --stdio`` with this interpreter.
DEFAULT_HOST_COMMAND: Final = (sys.executable, "-m", "codemode", "host", "--stdio")
#: How long a host whose stdout ended may take to report its exit status (K2 vs K1, §9.8).
EXIT_STATUS_GRACE: Final = 1.0
_POLL: Final = 0.01
_STDERR_LIMIT: Final = 1 << 16


class HostProcess:
    """One spawned host child and the V1 connection over its stdin/stdout."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        program: str,
        transport: StreamTransport | None = None,
        stdin: asyncio.StreamWriter | None = None,
        *,
        wire_revision: WireRevision = WireRevision.PINNED,
        response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
    ) -> None:
        self.process = process
        self.program = program
        self.closing = False
        if transport is None:
            assert process.stdout is not None and process.stdin is not None
            transport = StreamTransport(process.stdout, process.stdin)
            stdin = process.stdin
        self._stdin = stdin
        self.connection = V1ClientConnection(
            transport,
            exit_status=self._exit_status,
            wire_revision=wire_revision,
            response_timeout=response_timeout,
        )
        self.connection.add_death_callback(self._connection_died)
        self._stderr = asyncio.create_task(self._log_stderr(), name="codemode-host-stderr")
        self._reaper: asyncio.Task[None] | None = None

    @classmethod
    async def spawn(
        cls,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        wire_revision: WireRevision = WireRevision.PINNED,
        response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
    ) -> HostProcess:
        """Start ``command`` and handshake; raise C1 (spawn) or C2-C5 (handshake).

        ``wire_revision`` is the shape the client accepts runtime responses in; the command must
        start a host that writes that shape. ``response_timeout``: as on the provider."""
        program = command[0]
        loop = asyncio.get_running_loop()
        # Our own pipe ends, connected straight to the loop: data reaches the machine in the
        # iteration it arrives (a subprocess transport defers every chunk by one call_soon).
        child_in, parent_out = os.pipe()
        parent_in, child_out = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=child_in,
                stdout=child_out,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group: killed as a whole
                preexec_fn=child_preexec(loop),  # its stdout ends when it closes it (uvloop)
                env=None if env is None else dict(env),
                limit=_STDERR_LIMIT,
            )
        except (OSError, ValueError) as error:
            os.close(parent_in)
            os.close(parent_out)
            raise CodeModeError(host_spawn_failed(program, error)) from None
        finally:
            os.close(child_in)
            os.close(child_out)
        write_pipe, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(parent_out, "wb", 0)
        )
        writer = asyncio.StreamWriter(write_pipe, protocol, None, loop)
        # Reads are pushed: each chunk is decoded and dispatched in the iteration that read it
        # (no reader task to wake). The client never stops reading for its own writes: the host
        # pauses its reading while its writes to us back up, and two ends that both paused
        # would wait on each other for ever.
        transport = await pipe_transport(
            os.fdopen(parent_in, "rb", 0), writer, pause_while_backlogged=False
        )
        host = cls(
            process,
            program,
            transport,
            writer,
            wire_revision=wire_revision,
            response_timeout=response_timeout,
        )
        try:
            await host.connection.handshake(timeout=handshake_timeout)
        except BaseException:
            await host.kill()
            raise
        host.connection.start()
        return host

    @property
    def pid(self) -> int:
        """The child's process id (also its process group id)."""
        return self.process.pid

    def is_alive(self) -> bool:
        """True while the connection works."""
        return self.connection.is_alive()

    async def _exit_status(self) -> int | None:
        # stdout ended: a host that exits right away reports its status (K2), else K1 (§9.8).
        return await self.wait_exit(EXIT_STATUS_GRACE)

    async def wait_exit(self, timeout: float) -> int | None:
        """The exit status once the child exited, or ``None`` after ``timeout`` seconds.

        Polls: ``Process.wait()`` also waits for every pipe to close, which a grandchild that
        inherited one can delay indefinitely.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.process.returncode is None and loop.time() < deadline:
            await asyncio.sleep(_POLL)
        return self.process.returncode

    def _connection_died(self, reason: str) -> None:
        logger.debug("code-mode host %s: connection failed: %s", self.pid, reason)
        if not self.closing and self._reaper is None:
            self._reaper = asyncio.ensure_future(self.kill())

    @property
    def finished(self) -> bool:
        """True once the child was reaped and nothing is left to clean up."""
        reaper = self._reaper
        return self.process.returncode is not None and (reaper is None or reaper.done())

    async def kill(self) -> None:
        """Kill the child's process group and reap it; idempotent."""
        # The whole group, even when the host itself already exited: whatever it spawned
        # (its JavaScript engine) must not outlive it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        await self.wait_exit(SHUTDOWN_TIMEOUT)
        await self.connection.aclose()
        await self._finish_stderr()

    async def aclose(self, sessions: Sequence[RemoteSession] = ()) -> None:
        """Shut down ``sessions``, close stdin, give the child 5 s to exit, then kill it."""
        self.closing = True
        if self.connection.is_alive() and sessions:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SHUTDOWN_TIMEOUT):
                    await asyncio.gather(
                        *(session.shutdown() for session in sessions), return_exceptions=True
                    )
        stdin = self._stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        await self.wait_exit(SHUTDOWN_TIMEOUT)
        await self.kill()
        if self._reaper is not None:
            await self._reaper

    async def _finish_stderr(self) -> None:
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            async with asyncio.timeout(1.0):
                await asyncio.shield(self._stderr)
        self._stderr.cancel()

    async def _log_stderr(self) -> None:
        stream = self.process.stderr
        assert stream is not None
        while True:
            try:
                line = await stream.readline()
            except ValueError:
                # A line longer than the buffer: log what is there and go on.
                line = await stream.read(_STDERR_LIMIT)
            except OSError:
                return
            if not line:
                return
            logger.debug(
                "code-mode host %s: %s",
                self.process.pid,
                line.decode("utf-8", "replace").rstrip("\n"),
            )


class ProcessOwnedCodeModeSessionProvider(SharedConnectionProvider[HostProcess]):
    """Creates :class:`RemoteSession` objects on one shared host child process (§9.1).

    ``command`` defaults to ``[sys.executable, "-m", "codemode", "host", "--stdio"]`` (plus
    ``--wire-revision latest`` when ``wire_revision`` is ``latest``). ``wire_revision`` is the
    shape of runtime responses the client accepts: ``pinned`` (V1 as pinned, the default) or
    ``latest`` (upstream 0.164+, with timing fields); a host that writes the other shape fails at
    its first runtime response (``docs/decisions/0007-wire-revisions.md``). The process
    is spawned on first use (one spawn at a time) and reused while its connection lives; after
    it died, the next ``create_session`` spawns a fresh one. A pipe has no keepalive: a host that
    stops answering is noticed when a request goes unanswered for ``response_timeout`` seconds
    (default 60) past its runtime allowance; then it is killed. Close with :meth:`aclose`.
    """

    def __init__(
        self,
        command: Sequence[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        wire_revision: WireRevision | str = WireRevision.PINNED,
        response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
    ) -> None:
        super().__init__()
        self.wire_revision = WireRevision(wire_revision)
        self.response_timeout = checked_seconds("response_timeout", response_timeout)
        if command is None:
            command = list(DEFAULT_HOST_COMMAND)
            if self.wire_revision is not WireRevision.PINNED:
                command += ["--wire-revision", self.wire_revision.value]
        self.command = list(command)
        if not self.command:
            raise ValueError("the host command must not be empty")
        self._env = env
        self._handshake_timeout = handshake_timeout

    @property
    def host(self) -> HostProcess | None:
        """The current host process, if one was spawned and is still alive."""
        return self.link

    async def _connect(self) -> HostProcess:
        return await HostProcess.spawn(
            self.command,
            env=self._env,
            handshake_timeout=self._handshake_timeout,
            wire_revision=self.wire_revision,
            response_timeout=self.response_timeout,
        )
