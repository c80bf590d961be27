"""Protocol V1 over stdio and the gRPC carrier beside the embedded session and raw echoes, same run.

Run: ``python -m benchmarks.transport`` from the repository root (about a minute on 2 cores).
Prints two Markdown tables. The same cells served, and the same frame echoed, five ways, measured
interleaved in one run:

* **stdio session**: :class:`ProcessOwnedCodeModeSessionProvider` (``python -m codemode host
  --stdio`` as a child, Protocol V1 on its stdin/stdout);
* **embedded session**: :class:`LocalSessionProvider` in this process (an engine process of its
  own per session, as the host gives its sessions; no V1 hop);
* **raw framed echo**: a tiny blocking Python child that reads length-prefixed frames from stdin
  and writes them back, driven from here by an asyncio subprocess with :func:`encode_frame` and
  :class:`FrameDecoder` (typed decode, like the client). The frame is the ``delegate/request`` the
  host sends for the benchmark's tool call. A second echo child runs the project's
  :func:`stdio_transport` (the host's own carrier) and writes back the bytes it reads: the price
  of one asyncio Python hop, as a diagnostic.
* **gRPC session**: :class:`GrpcCodeModeSessionProvider` on a ``python -m codemode host --listen
  grpc://127.0.0.1:0`` child (a nested call is a ``ToolCall`` on the session's subscription
  stream, answered by a ``CompleteToolCall`` unary rpc);
* **raw grpc.aio echo**: a child running a bare ``grpc.aio`` server with generic handlers and
  identity (bytes) serializers, a unary echo and a bidirectional stream echo, driven from here on
  one ``grpc.aio`` channel with the same ``delegate/request`` bytes: the floor of the carrier.

Figures: nested tool call round trip (a cell awaiting ``tools.echo`` one call at a time; each
interval between two successive ``invoke_tool`` calls of the delegate is one round trip), 1,000
calls per ``Promise.all`` (timed inside the cell, amortised per call), and ``execute`` -> initial
response of ``text("hi")``; as a diagnostic, the CPU each process spent per parallel call (read from
``/proc``: this process, which is the client or the embedded session, the host, the engine). The
footer checks the transport issue's goals: the stdio session adds
at most 1.5x the raw echo's round trip on top of the embedded round trip, and 1,000 parallel
nested calls amortise to <= 30 us each over stdio. Last, with everything else closed, the raw echo
runs with both ends blocking and pinned to one CPU, then to two: what a wake-up costs here.

The third table is a load: 128 cells started at once on one session (over stdio: one connection,
the host's default cap of active cells), each awaiting 50 echoes one by one, on the stdio session
and on the embedded session: calls per second, and the sequential call's latency under that load
(p50 / p99 of the intervals between successive calls of one cell).

The second table sets the gRPC session beside stdio, embedded and the raw echoes for the same
nested-call and execute figures, and adds large-result throughput: a cell awaits ``tools.big``,
which returns a string of 8 or 32 MiB (timed in the cell), against the one-way rate of the same
number of bytes through each raw echo (half its round trip).
"""

from __future__ import annotations

import os

# Before grpc: the runtime forks engine processes, which gRPC's fork handlers crash.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import asyncio
import contextlib
import itertools
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, TypeVar

from grpc import aio

from benchmarks.common import (
    cpu_ticks,
    loop_arguments,
    loop_source,
    only_text,
    percentile,
    progress,
    quiesce,
    run_on_loop,
)
from codemode.client import (
    DEFAULT_HOST_COMMAND,
    ProcessOwnedCodeModeSessionProvider,
    RemoteSession,
)
from codemode.client.grpc import GrpcCodeModeSessionProvider
from codemode.protocol import (
    JSON,
    CodeModeNestedToolCall,
    CodeModeToolKind,
    ExecuteRequest,
    ToolDefinition,
    ToolName,
)
from codemode.protocol.v1 import NEED_DATA, FrameDecoder, MessageDecoder, encode_frame
from codemode.protocol.v1.conversions import nested_tool_call_to_wire
from codemode.protocol.v1.messages import DelegateRequestMessage, HostToClient, ToolInvoke
from codemode.runtime import LocalSession, LocalSessionProvider
from codemode.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
)

T = TypeVar("T")

TRIVIAL: Final = 'text("hi")'
SEQ_CALLS: Final = 300  # per cell: intervals between successive calls are round trips
PAR_CALLS: Final = 1000  # per Promise.all (the host allows 1,024 unresolved callbacks)
PAR_ROUNDS: Final = 3  # Promise.all rounds per cell, so that Date.now() (1 ms) is precise enough
CELLS: Final = 9  # cells per nested-call figure and session kind, interleaved
EXEC_SAMPLES: Final = 150  # execute -> initial response samples per session kind
ECHO_WARMUP: Final = 200
PING_PONGS: Final = 2000  # pinned blocking round trips per CPU placement (environment figure)
SETTLE_MS: Final = 30  # a cell waits this long before its loops, so its admission is over
STEP_TIMEOUT: Final = 60.0  # no single step may take longer: a hang fails loudly

SIZES_MIB: Final = (8, 32)  # large tool results
BIG_SAMPLES: Final = 5  # per size and session kind (and echo), interleaved
LOAD_CELLS: Final = 128  # cells at once on one session (the host's default max active cells)
LOAD_CALLS: Final = 50  # sequential echoes per cell
LOAD_RUNS: Final = 3  # per session kind, alternating
LOAD_YIELD_MS: Final = 600_000  # a loaded cell must complete, not yield
MIB: Final = 1024 * 1024

GOAL_OVERHEAD_VS_ECHO: Final = 1.5
GOAL_PAR_US: Final = 30.0

ECHO_TOOL: Final = ToolDefinition("echo", ToolName.plain("echo"), "Echo", CodeModeToolKind.FUNCTION)
BIG_TOOL: Final = ToolDefinition("big", ToolName.plain("big"), "Big", CodeModeToolKind.FUNCTION)

#: The blocking echo child: whole frames back as soon as they are complete, nothing else.
ECHO_CHILD: Final = """\
import os
pending = b""
while chunk := os.read(0, 1 << 16):
    pending += chunk
    end, size = 0, len(pending)
    while size - end >= 4:
        length = int.from_bytes(pending[end : end + 4], "little")
        if size - end - 4 < length:
            break
        end += 4 + length
    if end:
        out = memoryview(pending)[:end]
        while out:
            out = out[os.write(1, out) :]
        pending = pending[end:]
"""

#: The bulk echo child (large payloads): reads one length-prefixed frame into a buffer of its
#: size, writes it back, and again (:data:`ECHO_CHILD` re-joins bytes, quadratic for MiBs).
BULK_ECHO_CHILD: Final = """\
import os
while header := os.read(0, 4):
    while len(header) < 4:
        header += os.read(0, 4 - len(header))
    frame = bytearray(4 + int.from_bytes(header, "little"))
    frame[:4] = header
    view, got = memoryview(frame), 4
    while got < len(frame):
        got += os.readv(0, [view[got:]])
    while view:
        view = view[os.write(1, view) :]
"""

#: The asyncio echo child: the host's carrier (``stdio_transport``) answering every frame.
ASYNCIO_ECHO_CHILD: Final = """\
import asyncio
from codemode.transports import stdio_transport

async def main() -> None:
    transport = await stdio_transport()
    if getattr(transport, "pushes", False):  # as the host reads: answered as read
        transport.push_to(lambda data, lane: transport.send(data))
    while (item := await transport.receive()) is not None:
        transport.send(item[0])  # the bytes as read: whole frames go back unchanged

asyncio.run(main())
"""

#: The largest gRPC message either end of the raw echo accepts (a 32 MiB payload and then some).
GRPC_ECHO_LIMIT: Final = 64 * MIB + 4096

#: The raw ``grpc.aio`` echo child: a unary echo and a bidirectional stream echo of bytes
#: (generic handlers, no serializers: requests and responses are the bytes on the wire).
GRPC_ECHO_SERVER: Final = f"""\
import asyncio
import os
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
import grpc
from grpc import aio

async def unary(request, context):
    return request

async def stream(requests, context):
    while (message := await context.read()) is not aio.EOF:
        await context.write(message)

async def main():
    limit = {GRPC_ECHO_LIMIT}
    server = aio.server(options=[
        ("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
    ])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {{
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
    }}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


# -- measuring aids -----------------------------------------------------------------------------


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (empty off Linux)."""
    children: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children.extend(int(child) for child in (task / "children").read_text().split())
    except OSError:
        return []
    return children


def process_ticks(pids: list[int]) -> list[int]:
    """CPU ticks used so far by this process, then by each of ``pids`` (0 where unknown)."""
    return [cpu_ticks(pid) or 0 for pid in (os.getpid(), *pids)]


async def bounded(awaitable: Awaitable[T]) -> T:
    """``awaitable`` under :data:`STEP_TIMEOUT`: a hang ends the run instead of stalling it."""
    async with asyncio.timeout(STEP_TIMEOUT):
        return await awaitable


# -- the sessions -------------------------------------------------------------------------------


class EchoDelegate(CodeModeSessionDelegate):
    """Serves ``echo`` (returns its input at once) and notes when each call arrived."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.last: CodeModeNestedToolCall | None = None
        #: Arrivals per cell, while a load runs (``None`` otherwise).
        self.by_cell: dict[str, list[float]] | None = None

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        """Note the arrival time and return the input unchanged."""
        now = time.perf_counter()
        if self.by_cell is not None:
            self.by_cell.setdefault(str(invocation.cell_id), []).append(now)
        else:
            self.arrivals.append(now)
        self.last = invocation
        return invocation.input


class BulkDelegate(EchoDelegate):
    """``echo`` as :class:`EchoDelegate`, and ``big``: a string of ``input.mib`` MiB."""

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        """A big string for ``big``; else note the arrival and echo the input."""
        if invocation.tool_name.name == "big":
            assert isinstance(invocation.input, dict)
            return "x" * big_length(int(invocation.input["mib"]))
        return await super().invoke_tool(invocation, cancellation)


def big_length(mib: int) -> int:
    """Characters of the ``mib`` MiB result (a little less, so that any frame around it fits)."""
    return mib * MIB - 256


@dataclass
class Served:
    """One session under test, its delegate, and the processes that serve it."""

    name: str
    session: CodeModeSession
    delegate: EchoDelegate
    pids: list[int]

    async def run(self, source: str) -> str:
        """Execute ``source`` (with the echo tool) to completion and return its text."""
        started = await bounded(self.session.execute(ExecuteRequest("bench", source, [ECHO_TOOL])))
        return only_text(await bounded(started.initial_response()))

    async def round_trips(self) -> list[float]:
        """Seconds per nested call round trip: intervals between successive ``invoke_tool``."""
        self.delegate.arrivals.clear()
        await self.run(loop_source("seq", "tools.echo", SEQ_CALLS, 1, SETTLE_MS))
        arrivals = self.delegate.arrivals
        assert len(arrivals) == SEQ_CALLS, len(arrivals)
        return [after - before for before, after in itertools.pairwise(arrivals)]

    async def parallel(self) -> float:
        """Seconds per call, amortised, of ``PAR_ROUNDS`` x ``Promise.all`` of ``PAR_CALLS``."""
        milliseconds = float(
            await self.run(loop_source("par", "tools.echo", PAR_CALLS, PAR_ROUNDS, SETTLE_MS))
        )
        return milliseconds / 1e3 / (PAR_CALLS * PAR_ROUNDS)

    async def execute_latency(self) -> float:
        """Seconds from ``execute`` to the initial response of the trivial cell."""
        start = time.perf_counter()
        started = await bounded(self.session.execute(ExecuteRequest("bench", TRIVIAL)))
        response = await bounded(started.initial_response())
        elapsed = time.perf_counter() - start
        assert only_text(response) == "hi"
        return elapsed

    async def load(self, cells: int, calls: int) -> tuple[float, list[float]]:
        """``cells`` cells at once, each awaiting ``calls`` echoes one by one: calls per second
        (all calls / wall time) and every interval between successive calls of one cell (s)."""
        source = loop_source("seq", "tools.echo", calls, 1, 0)
        self.delegate.by_cell = {}
        try:
            start = time.perf_counter()
            started = [
                await bounded(
                    self.session.execute(
                        ExecuteRequest("load", source, [ECHO_TOOL], yield_time_ms=LOAD_YIELD_MS)
                    )
                )
                for _ in range(cells)
            ]
            for cell in started:
                only_text(await bounded(cell.initial_response()))
            elapsed = time.perf_counter() - start
            arrivals = self.delegate.by_cell
        finally:
            self.delegate.by_cell = None
        assert sum(map(len, arrivals.values())) == cells * calls
        gaps = [b - a for times in arrivals.values() for a, b in itertools.pairwise(times)]
        return cells * calls / elapsed, gaps

    async def big_result(self, mib: int) -> float:
        """Seconds for a ``mib`` MiB tool result to reach the cell (timed in the cell)."""
        source = (
            f"const started = Date.now(); const value = await tools.big({{mib: {mib}}});"
            " text(String(Date.now() - started) + ' ' + value.length);"
        )
        request = ExecuteRequest("big", source, [ECHO_TOOL, BIG_TOOL])
        started = await bounded(self.session.execute(request))
        milliseconds, size = only_text(await bounded(started.initial_response())).split()
        assert int(size) == big_length(mib), size
        return max(float(milliseconds), 0.5) / 1e3


# -- the echo baselines -------------------------------------------------------------------------


class EchoPeer:
    """A child process echoing frames on its stdio, driven like the client drives its host."""

    def __init__(self, process: asyncio.subprocess.Process, frame: DelegateRequestMessage) -> None:
        self.process = process
        self.message = frame
        self._frames: FrameDecoder[HostToClient] = FrameDecoder(MessageDecoder(HostToClient))

    @classmethod
    async def spawn(cls, script: str, frame: DelegateRequestMessage) -> EchoPeer:
        """Start ``python -c script`` with piped stdin/stdout."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(process, frame)

    async def _receive(self) -> HostToClient:
        stdout = self.process.stdout
        assert stdout is not None
        frames = self._frames
        while True:
            message = frames.next_message()
            if message is not NEED_DATA:
                assert isinstance(message, DelegateRequestMessage), message
                return message
            chunk = await stdout.read(1 << 16)
            if not chunk:
                raise EOFError("the echo child closed its stdout")
            frames.receive_data(chunk)

    def _send(self, message: HostToClient) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(encode_frame(message))

    async def round_trips(self, count: int) -> list[float]:
        """Seconds per round trip of one frame, ``count`` times one after the other."""
        message = self.message
        samples: list[float] = []
        for _ in range(count):
            start = time.perf_counter()
            self._send(message)
            await self._receive()
            samples.append(time.perf_counter() - start)
        return samples

    async def burst(self, count: int) -> float:
        """Seconds per frame, amortised, with ``count`` frames in flight (written, then read)."""
        message = self.message
        start = time.perf_counter()
        for _ in range(count):
            self._send(message)
        for _ in range(count):
            await self._receive()
        return (time.perf_counter() - start) / count

    async def bulk(self, payload: bytes) -> float:
        """Seconds per round trip of one frame carrying ``payload`` (raw bytes, not decoded)."""
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        frame = len(payload).to_bytes(4, "little") + payload
        start = time.perf_counter()
        stdin.write(frame)
        await stdout.readexactly(len(frame))
        return time.perf_counter() - start

    async def aclose(self) -> None:
        """Close stdin (the child exits at end of stream); kill it if it does not."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        try:
            async with asyncio.timeout(5.0):
                await self.process.wait()
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


class GrpcEcho:
    """The raw ``grpc.aio`` echo child and one channel to it (unary and stream echo)."""

    def __init__(self, child: subprocess.Popen[str], stderr: IO[bytes], port: str) -> None:
        self.child = child
        self._stderr = stderr
        limit = GRPC_ECHO_LIMIT
        self.channel = aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
            ],
        )
        self._unary: aio.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(
            "/bench.Echo/Unary"
        )
        self._stream: Any = self.channel.stream_stream("/bench.Echo/Stream")()

    @classmethod
    def spawn(cls) -> GrpcEcho:
        """Start the echo server child; it prints its port."""
        child, stderr, port = spawn_line(sys.executable, "-c", GRPC_ECHO_SERVER)
        return cls(child, stderr, port)

    async def _call(self, message: bytes) -> bytes:
        reply: bytes = await self._unary(message)
        return reply

    async def unary_round_trips(self, message: bytes, count: int) -> list[float]:
        """Seconds per unary echo of ``message``, ``count`` times one after the other."""
        samples: list[float] = []
        for _ in range(count):
            start = time.perf_counter()
            await self._call(message)
            samples.append(time.perf_counter() - start)
        return samples

    async def stream_round_trips(self, message: bytes, count: int) -> list[float]:
        """Seconds per stream echo round trip of ``message`` (one message each way)."""
        stream = self._stream
        samples: list[float] = []
        for _ in range(count):
            start = time.perf_counter()
            await stream.write(message)
            reply = await stream.read()
            samples.append(time.perf_counter() - start)
            assert reply is not aio.EOF
        return samples

    async def unary_burst(self, message: bytes, count: int) -> float:
        """Seconds per call, amortised, of ``count`` unary echoes in flight at once."""
        start = time.perf_counter()
        await asyncio.gather(*(self._call(message) for _ in range(count)))
        return (time.perf_counter() - start) / count

    async def stream_burst(self, message: bytes, count: int) -> float:
        """Seconds per message, amortised, of ``count`` stream echoes (written while read)."""
        stream = self._stream

        async def write_all() -> None:
            for _ in range(count):
                await stream.write(message)

        start = time.perf_counter()
        writing = asyncio.ensure_future(write_all())
        for _ in range(count):
            assert await stream.read() is not aio.EOF
        await writing
        return (time.perf_counter() - start) / count

    async def unary_bulk(self, payload: bytes) -> float:
        """Seconds per unary echo round trip of ``payload``."""
        start = time.perf_counter()
        reply = await self._call(payload)
        elapsed = time.perf_counter() - start
        assert len(reply) == len(payload)
        return elapsed

    async def stream_bulk(self, payload: bytes) -> float:
        """Seconds per stream echo round trip of ``payload``."""
        start = time.perf_counter()
        await self._stream.write(payload)
        reply = await self._stream.read()
        elapsed = time.perf_counter() - start
        assert len(reply) == len(payload)
        return elapsed

    async def aclose(self) -> None:
        """End the stream, close the channel and stop the child."""
        with contextlib.suppress(aio.AioRpcError):
            await self._stream.done_writing()
        self._stream.cancel()
        await self.channel.close()
        stop_child(self.child, self._stderr)


def spawn_line(*command: str) -> tuple[subprocess.Popen[str], IO[bytes], str]:
    """Start ``command`` (stderr to a temporary file); its first stdout line (a URL or a port)."""
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop_child
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if not line:
        child.wait(5.0)
        stderr.seek(0)
        raise RuntimeError(f"{command} printed nothing: {stderr.read().decode(errors='replace')}")
    return child, stderr, line


def stop_child(child: subprocess.Popen[str], stderr: IO[bytes]) -> None:
    """SIGTERM ``child`` and wait for it (kill after 30 s)."""
    child.terminate()
    try:
        child.wait(30.0)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    if child.stdout is not None:
        child.stdout.close()
    stderr.close()


def pinned_round_trip(frame: bytes, here: int, there: int, count: int) -> float:
    """p50 seconds of a blocking round trip of ``frame`` through the blocking echo child, with
    this process pinned to CPU ``here`` and the child to CPU ``there`` (Linux only)."""
    allowed = os.sched_getaffinity(0)
    pin = f"import os\nos.sched_setaffinity(0, {{{there}}})\n"
    child = subprocess.Popen(
        [sys.executable, "-c", pin + ECHO_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert child.stdin is not None and child.stdout is not None
    samples: list[float] = []
    try:
        os.sched_setaffinity(0, {here})
        out, into = child.stdin.fileno(), child.stdout.fileno()
        for _ in range(count):
            start = time.perf_counter()
            os.write(out, frame)
            received = 0
            while received < len(frame):
                received += len(os.read(into, 1 << 16))
            samples.append(time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, allowed)
        child.stdin.close()
        try:
            child.wait(5.0)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()
    return percentile(samples[count // 10 :], 50)


def placement_note(message: DelegateRequestMessage) -> str:
    """The price of a wake-up on this machine: the raw echo pinned to one CPU vs two."""
    if not hasattr(os, "sched_setaffinity"):
        return "Wake-ups: CPU pinning is not available here."
    cpus = sorted(os.sched_getaffinity(0))
    frame = bytes(encode_frame(message))
    same = pinned_round_trip(frame, cpus[0], cpus[0], PING_PONGS)
    if len(cpus) < 2:
        return f"Wake-ups: raw echo, both ends blocking on one CPU: {_us(same):.0f} us p50."
    cross = pinned_round_trip(frame, cpus[0], cpus[1], PING_PONGS)
    return (
        f"Wake-ups: the raw echo with both ends blocking and pinned: {_us(same):.0f} us p50 on one"
        f" CPU, {_us(cross):.0f} us on two (a wake-up across CPUs costs"
        f" ~{_us(cross - same) / 2:.0f} us here); unpinned processes land either way."
    )


def echo_frame(session_id: str, invocation: CodeModeNestedToolCall) -> DelegateRequestMessage:
    """The ``delegate/request`` a host sends for ``invocation`` (what the echo carries)."""
    return DelegateRequestMessage(1, session_id, ToolInvoke(nested_tool_call_to_wire(invocation)))


# -- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One table line."""

    metric: str
    stdio: str
    embedded: str
    added: str
    echo: str
    added_per_echo: str


def print_table(rows: list[Row], footer: list[str]) -> None:
    """Print ``rows`` as one Markdown table, then the footer lines."""
    head = (
        "metric",
        "stdio session",
        "embedded session",
        "added by stdio",
        "raw framed echo",
        "added / echo",
    )
    body = [(r.metric, r.stdio, r.embedded, r.added, r.echo, r.added_per_echo) for r in rows]
    print_markdown(head, body, footer)


def print_markdown(
    head: tuple[str, ...], body: Sequence[tuple[str, ...]], footer: list[str]
) -> None:
    """Print one Markdown table (columns padded), a blank line, then the footer lines."""
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]

    def show(cells: tuple[str, ...]) -> None:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")

    show(head)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in body:
        show(line)
    print()
    for note in footer:
        print(note)


def _us(seconds: float) -> float:
    return seconds * 1e6


def _p50_mean(samples: list[float]) -> str:
    return f"{_us(percentile(samples, 50)):.0f} ({_us(statistics.fmean(samples)):.0f})"


def _cpu_per_call(ticks: list[int] | None, *, host: bool = True) -> str:
    """Ticks of the parallel rounds as microseconds of CPU per call, one figure per process."""
    if not ticks or not any(ticks):
        return "n/a"
    calls = CELLS * PAR_ROUNDS * PAR_CALLS
    # This process, the host (if any), then the engine: any later pid is an engine too (a spare).
    split = 2 if host else 1
    figures = [
        f"{tick / os.sysconf('SC_CLK_TCK') / calls * 1e6:.1f}"
        for tick in (*ticks[:split], sum(ticks[split:]))
    ]
    return " / ".join(figures) if host else f"{figures[0]} / - / {figures[1]}"


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Figures:
    """Everything measured, before formatting."""

    seq: dict[str, list[float]]
    par: dict[str, list[float]]
    execute: dict[str, list[float]]
    big: dict[tuple[str, int], list[float]]
    #: CPU ticks the parallel rounds took, per session kind: this process, then each of its pids.
    cpu: dict[str, list[int]]


SESSION_KINDS: Final = ("stdio", "embedded", "grpc")
GRPC_COLUMNS: Final = ("grpc", "stdio", "embedded")  # the session columns of the gRPC table
ECHO_KINDS: Final = ("echo", "asyncio echo", "grpc unary echo", "grpc stream echo")


async def measure(
    sessions: list[Served],
    echo: EchoPeer,
    asyncio_echo: EchoPeer,
    bulk_echo: EchoPeer,
    grpc_echo: GrpcEcho,
) -> Figures:
    """Interleave every measurement: sessions and echoes take turns, cell by cell."""
    pids = [pid for served in sessions for pid in served.pids]
    message = bytes(encode_frame(echo.message))  # what every echo carries
    seq: dict[str, list[float]] = {name: [] for name in (*SESSION_KINDS, *ECHO_KINDS)}
    par: dict[str, list[float]] = {name: [] for name in (*SESSION_KINDS, *ECHO_KINDS)}

    async def echo_round_trips(count: int) -> None:
        seq["echo"] += await bounded(echo.round_trips(count))
        seq["asyncio echo"] += await bounded(asyncio_echo.round_trips(count))
        seq["grpc unary echo"] += await bounded(grpc_echo.unary_round_trips(message, count))
        seq["grpc stream echo"] += await bounded(grpc_echo.stream_round_trips(message, count))

    progress(f"nested calls: {CELLS} cells x {SEQ_CALLS} sequential per session kind")
    for served in sessions:  # warm up: first cells compile, first frames allocate
        await served.round_trips()
    await echo_round_trips(ECHO_WARMUP)
    for samples in seq.values():  # the warm-up round trips do not count
        samples.clear()
    for _ in range(CELLS):
        for served in sessions:
            await quiesce(pids)
            seq[served.name] += await served.round_trips()
        await quiesce(pids)
        await echo_round_trips(SEQ_CALLS)
    progress(f"nested calls: {CELLS} cells x {PAR_ROUNDS} x Promise.all of {PAR_CALLS}")
    for served in sessions:
        await served.parallel()
    await bounded(grpc_echo.unary_burst(message, PAR_CALLS))
    await bounded(grpc_echo.stream_burst(message, PAR_CALLS))
    cpu: dict[str, list[int]] = {}
    for _ in range(CELLS):
        for served in sessions:
            await quiesce(pids)
            before = process_ticks(served.pids)
            par[served.name].append(await served.parallel())
            spent = [b - a for a, b in zip(before, process_ticks(served.pids), strict=True)]
            total = cpu.setdefault(served.name, [0] * len(spent))
            total[:] = [a + b for a, b in zip(total, spent, strict=True)]
        await quiesce(pids)
        for _ in range(PAR_ROUNDS):
            par["echo"].append(await bounded(echo.burst(PAR_CALLS)))
            par["asyncio echo"].append(await bounded(asyncio_echo.burst(PAR_CALLS)))
            par["grpc unary echo"].append(await bounded(grpc_echo.unary_burst(message, PAR_CALLS)))
            par["grpc stream echo"].append(
                await bounded(grpc_echo.stream_burst(message, PAR_CALLS))
            )
    progress(f"execute latency: {EXEC_SAMPLES} samples per session kind")
    execute: dict[str, list[float]] = {served.name: [] for served in sessions}
    for _ in range(3):
        for served in sessions:
            await quiesce(pids)
            await served.execute_latency()
    for _ in range(EXEC_SAMPLES):
        for served in sessions:
            await quiesce(pids)
            execute[served.name].append(await served.execute_latency())
    progress(f"large results: {', '.join(map(str, SIZES_MIB))} MiB x {BIG_SAMPLES}")
    big: dict[tuple[str, int], list[float]] = defaultdict(list)
    for served in sessions:  # warm up: the first big string grows the engines' heaps
        await served.big_result(SIZES_MIB[0])
    for mib in SIZES_MIB:
        payload = b"x" * (mib * MIB)
        for _ in range(BIG_SAMPLES):
            for served in sessions:
                await quiesce(pids)
                big[(served.name, mib)].append(await served.big_result(mib))
            await quiesce(pids)
            # The echoes carry the bytes there and back: one way is half the round trip.
            big[("echo", mib)].append(await bounded(bulk_echo.bulk(payload)) / 2)
            big[("grpc unary echo", mib)].append(await bounded(grpc_echo.unary_bulk(payload)) / 2)
            big[("grpc stream echo", mib)].append(await bounded(grpc_echo.stream_bulk(payload)) / 2)
    return Figures(seq, par, execute, big, cpu)


async def measure_load(sessions: list[Served]) -> dict[str, list[tuple[float, list[float]]]]:
    """``LOAD_CELLS`` x ``LOAD_CALLS`` on each session, ``LOAD_RUNS`` times, alternating."""
    progress(f"load: {LOAD_CELLS} cells x {LOAD_CALLS} sequential calls at once, {LOAD_RUNS} runs")
    pids = [pid for served in sessions for pid in served.pids]
    for served in sessions:  # warm up: the engines make their isolates
        await served.load(LOAD_CELLS // 4, 5)
    runs: dict[str, list[tuple[float, list[float]]]] = {served.name: [] for served in sessions}
    for _ in range(LOAD_RUNS):
        for served in sessions:
            await quiesce(pids)
            runs[served.name].append(await served.load(LOAD_CELLS, LOAD_CALLS))
    return runs


def load_table(
    runs: dict[str, list[tuple[float, list[float]]]],
) -> tuple[tuple[str, ...], list[tuple[str, ...]], list[str]]:
    """The load table: calls per second and sequential latency under load, per session kind."""
    head = ("session", "calls/s (median, min-max)", "sequential call under load, p50 / p99, ms")
    body: list[tuple[str, ...]] = []
    for name, results in runs.items():
        rates = [rate for rate, _ in results]
        gaps = [gap for _, run_gaps in results for gap in run_gaps]
        body.append(
            (
                name,
                f"{statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})",
                f"{percentile(gaps, 50) * 1e3:.2f} / {percentile(gaps, 99) * 1e3:.2f}",
            )
        )
    footer = [
        f"Load: {LOAD_CELLS} cells started at once on one session (stdio: one connection),"
        f" each awaiting {LOAD_CALLS} echoes one by one; {LOAD_RUNS} runs per session kind,"
        " alternating. Latency: intervals between successive calls of one cell, all runs."
    ]
    return head, body, footer


def table(figures: Figures, note: str) -> tuple[list[Row], list[str]]:
    """The rows and the footer (goals with met / NOT met)."""
    seq, par, execute = figures.seq, figures.par, figures.execute
    stdio_seq, embedded_seq = percentile(seq["stdio"], 50), percentile(seq["embedded"], 50)
    echo_seq, asyncio_seq = percentile(seq["echo"], 50), percentile(seq["asyncio echo"], 50)
    overhead = stdio_seq - embedded_seq
    stdio_par, embedded_par = statistics.median(par["stdio"]), statistics.median(par["embedded"])
    echo_par, asyncio_par = statistics.median(par["echo"]), statistics.median(par["asyncio echo"])
    exec_p50 = {name: percentile(samples, 50) for name, samples in execute.items()}
    exec_p99 = {name: percentile(samples, 99) for name, samples in execute.items()}
    exec_overhead = exec_p50["stdio"] - exec_p50["embedded"]
    rows = [
        Row(
            "nested call round trip, sequential, p50 (mean), us",
            _p50_mean(seq["stdio"]),
            _p50_mean(seq["embedded"]),
            f"{_us(overhead):+.0f}",
            f"{_p50_mean(seq['echo'])} round trip",
            f"{overhead / echo_seq:.1f}x",
        ),
        Row(
            f"nested calls, {PAR_CALLS:,} per Promise.all, us/call amortised",
            f"{_us(stdio_par):.1f}",
            f"{_us(embedded_par):.1f}",
            f"{_us(stdio_par - embedded_par):+.1f}",
            f"{_us(echo_par):.1f} per frame, {PAR_CALLS:,} in flight",
            f"{(stdio_par - embedded_par) / echo_par:.1f}x",
        ),
        Row(
            "trivial execute -> initial response, p50 / p99, ms",
            f"{exec_p50['stdio'] * 1e3:.2f} / {exec_p99['stdio'] * 1e3:.2f}",
            f"{exec_p50['embedded'] * 1e3:.2f} / {exec_p99['embedded'] * 1e3:.2f}",
            f"{exec_overhead * 1e3:+.2f} / {(exec_p99['stdio'] - exec_p99['embedded']) * 1e3:+.2f}",
            "(round trip above)",
            f"{exec_overhead / echo_seq:.1f}x (p50)",
        ),
        Row(
            "diagnostic: the echo answered by an asyncio child on `stdio_transport`,"
            " p50 (mean) / amortised, us",
            f"{_p50_mean(seq['asyncio echo'])} / {_us(asyncio_par):.1f} (asyncio echo)",
            "-",
            f"{_us(asyncio_seq - echo_seq):+.0f} / {_us(asyncio_par - echo_par):+.1f}",
            f"{_p50_mean(seq['echo'])} / {_us(echo_par):.1f}",
            f"{(asyncio_seq - echo_seq) / echo_seq:.1f}x / {(asyncio_par - echo_par) / echo_par:.1f}x",
        ),
        Row(
            "diagnostic: CPU per parallel call, us: this process (client) / host / engine",
            _cpu_per_call(figures.cpu.get("stdio")),
            _cpu_per_call(figures.cpu.get("embedded"), host=False),
            "-",
            "-",
            "-",
        ),
    ]
    budget = GOAL_OVERHEAD_VS_ECHO * echo_seq
    footer = [
        f"Goals (transport issue), Python {platform.python_version()}, {os.cpu_count()} CPUs:",
        f"- stdio adds <= {GOAL_OVERHEAD_VS_ECHO:g}x the raw echo round trip on top of embedded:"
        f" {_us(overhead):.0f} us added vs budget {_us(budget):.0f} us"
        f" ({GOAL_OVERHEAD_VS_ECHO:g} x {_us(echo_seq):.0f} us)"
        f" -- {_verdict(overhead <= budget)}",
        f"- {PAR_CALLS:,} parallel nested calls over stdio <= {GOAL_PAR_US:g} us each:"
        f" {_us(stdio_par):.1f} us -- {_verdict(_us(stdio_par) <= GOAL_PAR_US)}",
        f"Sequential: {CELLS} cells x {SEQ_CALLS} calls per session kind (p50 and mean of the"
        " intervals between successive delegate calls), echo: as many round trips, interleaved."
        f" Parallel: median of {CELLS} cells x {PAR_ROUNDS} Promise.all rounds, timed in the cell"
        f" (Date.now()); echo: median of {CELLS * PAR_ROUNDS} bursts. Execute: {EXEC_SAMPLES}"
        " samples per session kind, each after the engines went idle.",
        note,
    ]
    return rows, footer


def grpc_table(figures: Figures) -> tuple[tuple[str, ...], list[tuple[str, ...]], list[str]]:
    """The gRPC table: head, rows and footer."""
    seq, par, execute, big = figures.seq, figures.par, figures.execute, figures.big
    p50 = {name: percentile(samples, 50) for name, samples in seq.items()}
    amortised = {name: statistics.median(samples) for name, samples in par.items()}
    exec_p50 = {name: percentile(samples, 50) for name, samples in execute.items()}
    exec_p99 = {name: percentile(samples, 99) for name, samples in execute.items()}
    head = (
        "metric",
        "gRPC session",
        "stdio session",
        "embedded session",
        "added by gRPC (x unary echo)",
        "added by stdio (x framed echo)",
        "raw grpc.aio unary echo",
        "raw grpc.aio stream echo",
        "raw framed echo",
    )

    def added(values: dict[str, float], unit: Callable[[float], str]) -> tuple[str, str]:
        grpc_added = values["grpc"] - values["embedded"]
        stdio_added = values["stdio"] - values["embedded"]
        return (
            f"{unit(grpc_added)} ({grpc_added / values['grpc unary echo']:.1f}x)",
            f"{unit(stdio_added)} ({stdio_added / values['echo']:.1f}x)",
        )

    def us(value: float) -> str:
        return f"{_us(value):+.0f}"

    def us1(value: float) -> str:
        return f"{_us(value):+.1f}"

    def ms(pair: tuple[float, float]) -> str:
        return f"{pair[0] * 1e3:.2f} / {pair[1] * 1e3:.2f}"

    rows: list[tuple[str, ...]] = [
        (
            "nested call round trip, sequential, p50 (mean), us",
            *(_p50_mean(seq[name]) for name in GRPC_COLUMNS),
            *added(p50, us),
            *(_p50_mean(seq[name]) for name in ("grpc unary echo", "grpc stream echo", "echo")),
        ),
        (
            f"nested calls, {PAR_CALLS:,} per Promise.all, us/call amortised",
            *(f"{_us(amortised[name]):.1f}" for name in GRPC_COLUMNS),
            *added(amortised, us1),
            *(
                f"{_us(amortised[name]):.1f}, {PAR_CALLS:,} in flight"
                for name in ("grpc unary echo", "grpc stream echo", "echo")
            ),
        ),
    ]
    exec_pairs = {name: (exec_p50[name], exec_p99[name]) for name in GRPC_COLUMNS}
    exec_added = {
        name: (exec_p50[name] - exec_p50["embedded"], exec_p99[name] - exec_p99["embedded"])
        for name in ("grpc", "stdio")
    }
    rows.append(
        (
            "trivial execute -> initial response, p50 / p99, ms",
            *(ms(exec_pairs[name]) for name in GRPC_COLUMNS),
            f"{exec_added['grpc'][0] * 1e3:+.2f} / {exec_added['grpc'][1] * 1e3:+.2f}"
            f" ({exec_added['grpc'][0] / p50['grpc unary echo']:.1f}x p50)",
            f"{exec_added['stdio'][0] * 1e3:+.2f} / {exec_added['stdio'][1] * 1e3:+.2f}"
            f" ({exec_added['stdio'][0] / p50['echo']:.1f}x p50)",
            "(round trip above)",
            "(round trip above)",
            "(round trip above)",
        )
    )
    for mib in SIZES_MIB:
        rate = {
            name: mib / statistics.median(big[(name, mib)])
            for name in (*SESSION_KINDS, "grpc unary echo", "grpc stream echo", "echo")
        }
        rows.append(
            (
                f"{mib} MiB tool result, MiB/s (x embedded)",
                *(
                    f"{rate[name]:.0f} ({rate[name] / rate['embedded']:.2f}x)"
                    for name in GRPC_COLUMNS
                ),
                f"{rate['grpc'] / rate['grpc unary echo']:.2f}x the unary echo",
                f"{rate['stdio'] / rate['echo']:.2f}x the framed echo",
                *(
                    f"{rate[name]:.0f} one way"
                    for name in ("grpc unary echo", "grpc stream echo", "echo")
                ),
            )
        )
    floor = p50["grpc unary echo"] + p50["grpc stream echo"] / 2
    footer = [
        "A gRPC nested call is one ToolCall message on the subscription stream and one"
        " CompleteToolCall unary rpc: the raw floor of that pair is the unary echo plus half the"
        f" stream echo, {_us(floor):.0f} us p50, against {_us(p50['grpc'] - p50['embedded']):.0f}"
        " us added by the gRPC session.",
        f"gRPC: {CELLS} cells x {SEQ_CALLS} sequential calls and {CELLS} x {PAR_ROUNDS}"
        f" Promise.all rounds per session kind, {EXEC_SAMPLES} executes, interleaved with the"
        " stdio and embedded sessions above (same figures); the raw grpc.aio echoes carry the"
        " same delegate/request bytes, as many round trips and bursts as the framed echo."
        f" Large results: median of {BIG_SAMPLES} per size, timed in the cell (Date.now(), ms);"
        " an echo's one-way time is half its round trip of the same number of bytes (the framed"
        " echo of large frames is a child that reads each frame into one buffer).",
    ]
    return head, rows, footer


AnyProvider = (
    LocalSessionProvider | ProcessOwnedCodeModeSessionProvider | GrpcCodeModeSessionProvider
)


async def open_served(
    name: str,
    provider: AnyProvider,
    host_pid: int | None = None,
) -> Served:
    """Open a session on ``provider`` and find the processes serving it (``host_pid``: the gRPC
    host child)."""
    delegate = BulkDelegate()
    session = await bounded(provider.create_session(delegate))
    served = Served(name, session, delegate, [])
    await served.run(
        loop_source("seq", "tools.echo", 2, 1, SETTLE_MS)
    )  # the engine is up and has run a cell
    if isinstance(provider, LocalSessionProvider):
        engine = session.engine if isinstance(session, LocalSession) else None
        served.pids = [] if engine is None or engine.pid is None else [engine.pid]
    elif isinstance(provider, ProcessOwnedCodeModeSessionProvider):
        host = provider.host
        assert host is not None
        served.pids = [host.pid, *child_pids(host.pid)]
    else:
        assert host_pid is not None
        served.pids = [host_pid, *child_pids(host_pid)]
    return served


async def run() -> None:
    """Measure on one stdio host, one embedded provider, one gRPC host and the echo children;
    print the tables."""
    began = time.perf_counter()
    cleanup: list[Callable[[], Awaitable[Any]]] = []
    try:
        progress("starting the stdio and gRPC hosts, the embedded engine and the echo children")
        grpc_host, grpc_stderr, url = spawn_line(
            sys.executable,
            "-m",
            "codemode",
            "host",
            "--listen",
            "grpc://127.0.0.1:0",
            *loop_arguments(),
        )

        async def stop_grpc_host() -> None:
            stop_child(grpc_host, grpc_stderr)

        cleanup.append(stop_grpc_host)
        grpc_echo = GrpcEcho.spawn()
        cleanup.append(grpc_echo.aclose)
        remote = ProcessOwnedCodeModeSessionProvider([*DEFAULT_HOST_COMMAND, *loop_arguments()])
        cleanup.append(remote.aclose)
        local = LocalSessionProvider()
        cleanup.append(local.aclose)
        over_grpc = GrpcCodeModeSessionProvider(url)
        cleanup.append(over_grpc.aclose)
        stdio = await open_served("stdio", remote)
        embedded = await open_served("embedded", local)
        grpc_served = await open_served("grpc", over_grpc, grpc_host.pid)
        invocation = stdio.delegate.last
        assert invocation is not None and isinstance(stdio.session, RemoteSession)
        frame = echo_frame(stdio.session.session_id, invocation)
        echo = await EchoPeer.spawn(ECHO_CHILD, frame)
        cleanup.append(echo.aclose)
        asyncio_echo = await EchoPeer.spawn(ASYNCIO_ECHO_CHILD, frame)
        cleanup.append(asyncio_echo.aclose)
        bulk_echo = await EchoPeer.spawn(BULK_ECHO_CHILD, frame)
        cleanup.append(bulk_echo.aclose)
        await bounded(grpc_echo.channel.channel_ready())
        figures = await measure(
            [stdio, embedded, grpc_served], echo, asyncio_echo, bulk_echo, grpc_echo
        )
        loads = await measure_load([stdio, embedded])
    finally:
        for close in reversed(cleanup):
            await close()
    progress("wake-ups: pinned raw echo, one CPU and two")
    note = placement_note(frame)
    progress(f"done in {time.perf_counter() - began:.0f} s")
    rows, footer = table(figures, note)
    print_table(rows, footer)
    print()
    print_markdown(*grpc_table(figures))
    print()
    print_markdown(*load_table(loads))


def main() -> None:
    """Run the benchmark (``--loop asyncio|uvloop``, hosts included) and print the tables."""
    run_on_loop(run, __doc__)


if __name__ == "__main__":
    main()
