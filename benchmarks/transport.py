"""Protocol V1 over a child's stdio beside the embedded session and a raw framed echo, same run.

Run: ``python -m benchmarks.transport`` from the repository root (about 30 s on 2 cores). Prints
one Markdown table. Three ways of serving the same cells, measured interleaved in one run:

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

Figures: nested tool call round trip (a cell awaiting ``tools.echo`` one call at a time; each
interval between two successive ``invoke_tool`` calls of the delegate is one round trip), 1,000
calls per ``Promise.all`` (timed inside the cell, amortised per call), and ``execute`` -> initial
response of ``text("hi")``. The footer checks the transport issue's goals: the stdio session adds
at most 1.5x the raw echo's round trip on top of the embedded round trip, and 1,000 parallel
nested calls amortise to <= 30 us each over stdio. Last, with everything else closed, the raw echo
runs with both ends blocking and pinned to one CPU, then to two: what a wake-up costs here.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from benchmarks.common import loop_source, only_text, percentile, progress, quiesce
from codemode.client import ProcessOwnedCodeModeSessionProvider, RemoteSession
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

GOAL_OVERHEAD_VS_ECHO: Final = 1.5
GOAL_PAR_US: Final = 30.0

ECHO_TOOL: Final = ToolDefinition("echo", ToolName.plain("echo"), "Echo", CodeModeToolKind.FUNCTION)

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

#: The asyncio echo child: the host's carrier (``stdio_transport``) answering every frame.
ASYNCIO_ECHO_CHILD: Final = """\
import asyncio
from codemode.transports import stdio_transport

async def main() -> None:
    transport = await stdio_transport()
    while (item := await transport.receive()) is not None:
        transport.send(item[0])  # the bytes as read: whole frames go back unchanged

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

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        """Note the arrival time and return the input unchanged."""
        self.arrivals.append(time.perf_counter())
        self.last = invocation
        return invocation.input


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


# -- the echo baselines -------------------------------------------------------------------------


class EchoPeer:
    """A child process echoing frames on its stdio, driven like the client drives its host."""

    def __init__(self, process: asyncio.subprocess.Process, frame: DelegateRequestMessage) -> None:
        self.process = process
        self._message = frame
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
        message = self._message
        samples: list[float] = []
        for _ in range(count):
            start = time.perf_counter()
            self._send(message)
            await self._receive()
            samples.append(time.perf_counter() - start)
        return samples

    async def burst(self, count: int) -> float:
        """Seconds per frame, amortised, with ``count`` frames in flight (written, then read)."""
        message = self._message
        start = time.perf_counter()
        for _ in range(count):
            self._send(message)
        for _ in range(count):
            await self._receive()
        return (time.perf_counter() - start) / count

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


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Figures:
    """Everything measured, before formatting."""

    seq: dict[str, list[float]]
    par: dict[str, list[float]]
    execute: dict[str, list[float]]


async def measure(
    stdio: Served, embedded: Served, echo: EchoPeer, asyncio_echo: EchoPeer
) -> Figures:
    """Interleave every measurement: stdio, embedded and echoes take turns, cell by cell."""
    both = [stdio, embedded]
    pids = [pid for served in both for pid in served.pids]
    seq: dict[str, list[float]] = {"stdio": [], "embedded": [], "echo": [], "asyncio echo": []}
    par: dict[str, list[float]] = {"stdio": [], "embedded": [], "echo": [], "asyncio echo": []}
    progress(f"nested calls: {CELLS} cells x {SEQ_CALLS} sequential per session kind")
    for served in both:  # warm up: first cells compile, first frames allocate
        await served.round_trips()
    for peer in (echo, asyncio_echo):
        await peer.round_trips(ECHO_WARMUP)
    for _ in range(CELLS):
        for served in both:
            await quiesce(pids)
            seq[served.name] += await served.round_trips()
        await quiesce(pids)
        seq["echo"] += await bounded(echo.round_trips(SEQ_CALLS))
        seq["asyncio echo"] += await bounded(asyncio_echo.round_trips(SEQ_CALLS))
    progress(f"nested calls: {CELLS} cells x {PAR_ROUNDS} x Promise.all of {PAR_CALLS}")
    for served in both:
        await served.parallel()
    for _ in range(CELLS):
        for served in both:
            await quiesce(pids)
            par[served.name].append(await served.parallel())
        await quiesce(pids)
        for _ in range(PAR_ROUNDS):
            par["echo"].append(await bounded(echo.burst(PAR_CALLS)))
            par["asyncio echo"].append(await bounded(asyncio_echo.burst(PAR_CALLS)))
    progress(f"execute latency: {EXEC_SAMPLES} samples per session kind")
    execute: dict[str, list[float]] = {"stdio": [], "embedded": []}
    for _ in range(3):
        for served in both:
            await quiesce(pids)
            await served.execute_latency()
    for _ in range(EXEC_SAMPLES):
        for served in both:
            await quiesce(pids)
            execute[served.name].append(await served.execute_latency())
    return Figures(seq, par, execute)


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


async def open_served(
    name: str,
    provider: LocalSessionProvider | ProcessOwnedCodeModeSessionProvider,
) -> Served:
    """Open a session on ``provider`` and find the processes serving it."""
    delegate = EchoDelegate()
    session = await bounded(provider.create_session(delegate))
    served = Served(name, session, delegate, [])
    await served.run(
        loop_source("seq", "tools.echo", 2, 1, SETTLE_MS)
    )  # the engine is up and has run a cell
    if isinstance(provider, LocalSessionProvider):
        engine = session.engine if isinstance(session, LocalSession) else None
        served.pids = [] if engine is None or engine.pid is None else [engine.pid]
    else:
        host = provider.host
        assert host is not None
        served.pids = [host.pid, *child_pids(host.pid)]
    return served


async def run() -> None:
    """Measure on one stdio host, one embedded provider and two echo children; print the table."""
    began = time.perf_counter()
    cleanup: list[Callable[[], Awaitable[Any]]] = []
    try:
        remote = ProcessOwnedCodeModeSessionProvider()
        cleanup.append(remote.aclose)
        local = LocalSessionProvider()
        cleanup.append(local.aclose)
        progress("starting the stdio host, the embedded engine and the echo children")
        stdio = await open_served("stdio", remote)
        embedded = await open_served("embedded", local)
        invocation = stdio.delegate.last
        assert invocation is not None and isinstance(stdio.session, RemoteSession)
        frame = echo_frame(stdio.session.session_id, invocation)
        echo = await EchoPeer.spawn(ECHO_CHILD, frame)
        cleanup.append(echo.aclose)
        asyncio_echo = await EchoPeer.spawn(ASYNCIO_ECHO_CHILD, frame)
        cleanup.append(asyncio_echo.aclose)
        figures = await measure(stdio, embedded, echo, asyncio_echo)
    finally:
        for close in reversed(cleanup):
            await close()
    progress("wake-ups: pinned raw echo, one CPU and two")
    note = placement_note(frame)
    progress(f"done in {time.perf_counter() - began:.0f} s")
    rows, footer = table(figures, note)
    print_table(rows, footer)


def main() -> None:
    """Run the benchmark and print one table."""
    asyncio.run(run())


if __name__ == "__main__":
    main()
