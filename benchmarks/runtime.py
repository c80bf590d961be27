"""The embedded runtime's latency, nested-call, throughput and memory figures beside baselines.

Run: ``python -m benchmarks.runtime`` from the repository root (about 40 s on 2 cores). Prints one
Markdown table; every figure comes from :class:`LocalSession` (the public embedded session) and
stands beside a baseline measured in the same run, on the same engine process:

* execute -> initial response of ``text("hi")``, p50/p99, warm worker pool: beside the same source
  run by ``NodeEngine.run_cell`` with a minimal event sink (no session layer), which in turn stands
  beside a bare Python -> Node -> Python frame round trip (a ``terminate`` for an unknown cell,
  answered by the host's main thread at once; no worker involved);
* nested calls to a delegate whose ``invoke_tool`` returns at once, 500 awaited one by one and
  1,000 per ``Promise.all``, timed inside the cell: beside the same loops awaiting a JS-local
  ``async`` function;
* trivial cells per second, back to back and 4 in flight: beside the same through ``run_cell``;
* RSS (``VmRSS`` of the Node engine process + this process) per idle session and per running cell
  (blocked on ``await new Promise(() => {})``): beside the RSS before they existed.

The RSS rows and the idle detection read ``/proc`` (Linux); elsewhere they print ``n/a`` or sleep.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import subprocess
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from benchmarks.common import loop_source, only_text, percentile, progress, quiesce
from codemode.protocol import (
    JSON,
    CancellationToken,
    CodeModeNestedToolCall,
    CodeModeSessionDelegate,
    CodeModeToolKind,
    ContentItem,
    ExecuteRequest,
    ToolDefinition,
    ToolName,
    Yielded,
)
from codemode.runtime import LocalSession, LocalSessionProvider, NodeEngine, find_node

TRIVIAL: Final = 'text("hi")'
BLOCKED: Final = "await new Promise(() => {});"
#: What a session with no tools and an empty store sends the engine (``LocalSession._config``).
EMPTY_CONFIG: Final = '{"tools":[],"all":[],"store":[]}'
EXEC_SAMPLES: Final = 150
PIPE_SAMPLES_PER_EXEC: Final = 6
SEQ_CALLS: Final = 500
PAR_CALLS: Final = 1000
PAR_ROUNDS: Final = 3  # Promise.all rounds per cell, so that Date.now() (1 ms) is precise enough
CALL_CELLS: Final = 7  # cells per nested-call figure: median (and range) reported
LOCAL_SEQ_ROUNDS: Final = 1000  # the JS-local loops are cheap: repeat them so 1 ms ticks vanish
LOCAL_PAR_ROUNDS: Final = 100
LOCAL_CELLS: Final = 3
SETTLE_MS: Final = 50  # a cell waits this long before timing, so the pool refill is over
RATE_CELLS: Final = 80
CONCURRENCY: Final = 4
IDLE_SESSIONS: Final = 2000
BLOCKED_CELLS: Final = 16
WARM_WORKERS: Final = 2  # LocalSessionProvider's default pool

GOAL_EXEC_P50_MS: Final = 5.0
GOAL_SEQ_US: Final = 100.0
GOAL_PAR_US: Final = 20.0

ECHO: Final = ToolDefinition("echo", ToolName.plain("echo"), "Echo", CodeModeToolKind.FUNCTION)


# -- measuring aids -----------------------------------------------------------------------------


def proc_status_kib(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/PID/status`` (e.g. ``VmRSS``), or None off Linux."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


# -- the engine without the session layer -----------------------------------------------------


class Sink:
    """The least a ``CellEvents`` can do: note when the cell completed and when it exited."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.done: asyncio.Future[str | None] = loop.create_future()
        self.exited: asyncio.Future[str] = loop.create_future()

    def on_started(self) -> None:
        """Ignored."""

    def on_item(self, item: ContentItem) -> None:
        """Ignored."""

    def on_call(self, call_id: str, tool: int, input_json: str | None) -> None:
        """Not expected: baseline cells call no tools."""
        raise AssertionError("unexpected nested call")

    def on_notify(self, text: str) -> None:
        """Ignored."""

    def on_yield(self, at_ms: float = 0.0) -> None:
        """Ignored."""

    def on_done(self, error: str | None, writes: list[tuple[str, str]]) -> None:
        """The cell completed (``error`` is None on success)."""
        if not self.done.done():
            self.done.set_result(error)

    def on_exited(self, reason: str, detail: str | None) -> None:
        """The cell's isolate is gone."""
        if not self.done.done():
            self.done.set_result(f"exited: {reason} {detail}")
        if not self.exited.done():
            self.exited.set_result(reason)


def bare_cell(engine: NodeEngine, source: str) -> Sink:
    """Run ``source`` straight on the engine: no session, no ``Cell`` state machine."""
    sink = Sink()
    engine.run_cell(sink, source, EMPTY_CONFIG, None)
    return sink


_ping_keys = iter(range(-1, -(2**31), -1))  # negative keys never collide with real cells


async def pipe_round_trip(engine: NodeEngine) -> float:
    """Seconds for one frame Python -> Node host -> Python (no worker involved).

    A ``terminate`` for a cell the host does not know is answered at once with ``exited``.
    """
    key = next(_ping_keys)
    sink = Sink()
    engine._cells[key] = sink
    start = time.perf_counter()
    engine._send({"t": "terminate", "cell": key})
    await sink.exited
    return time.perf_counter() - start


async def engine_latency(engine: NodeEngine) -> float:
    """Seconds from ``run_cell`` to ``done`` of the trivial cell, without the session layer."""
    start = time.perf_counter()
    sink = bare_cell(engine, TRIVIAL)
    error = await sink.done
    elapsed = time.perf_counter() - start
    assert error is None, error
    await sink.exited
    return elapsed


async def engine_done(engine: NodeEngine) -> None:
    """Run the trivial cell on the bare engine; return at its completion (not its exit)."""
    error = await bare_cell(engine, TRIVIAL).done
    assert error is None, error


# -- the session side ---------------------------------------------------------------------------


class EchoDelegate(CodeModeSessionDelegate):
    """Serves ``echo``: returns its input at once."""

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        """Return the input unchanged."""
        return invocation.input


async def execute(session: LocalSession, source: str, tools: list[ToolDefinition]) -> str:
    """Execute ``source`` to completion and return its text output."""
    started = await session.execute(ExecuteRequest("bench", source, tools))
    return only_text(await started.initial_response())


async def session_latency(session: LocalSession) -> float:
    """Seconds from ``execute`` to the initial response of the trivial cell."""
    start = time.perf_counter()
    started = await session.execute(ExecuteRequest("bench", TRIVIAL))
    response = await started.initial_response()
    elapsed = time.perf_counter() - start
    assert only_text(response) == "hi"
    return elapsed


async def rate(lanes: list[Callable[[], Awaitable[object]]], cells: int) -> float:
    """Cells per second with one back-to-back loop per entry of ``lanes``."""
    per_lane = cells // len(lanes)

    async def lane(run_one: Callable[[], Awaitable[object]]) -> None:
        for _ in range(per_lane):
            await run_one()

    start = time.perf_counter()
    await asyncio.gather(*(lane(run_one) for run_one in lanes))
    return per_lane * len(lanes) / (time.perf_counter() - start)


@dataclass(frozen=True)
class Rss:
    """``VmRSS`` in KiB of the Node engine process and of this Python process."""

    node: int
    python: int

    @property
    def total(self) -> int:
        """Both processes together, KiB."""
        return self.node + self.python


def rss(node_pid: int) -> Rss | None:
    """Current RSS of the engine process and this process (None off Linux)."""
    node = proc_status_kib(node_pid, "VmRSS")
    python = proc_status_kib(os.getpid(), "VmRSS")
    if node is None or python is None:
        return None
    return Rss(node, python)


# -- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One table line: a figure, its baseline, what the baseline is, and how they compare."""

    metric: str
    value: str
    baseline: str
    baseline_is: str
    versus: str


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def latency_row(metric: str, samples: list[float], base: list[float], base_is: str) -> Row:
    """A p50 / p99 row in milliseconds, with the difference to the baseline."""
    p50, p99 = percentile(samples, 50), percentile(samples, 99)
    b50, b99 = percentile(base, 50), percentile(base, 99)
    return Row(
        metric,
        f"{_ms(p50)} / {_ms(p99)}",
        f"{_ms(b50)} / {_ms(b99)}",
        base_is,
        f"{(p50 - b50) * 1e3:+.2f} / {(p99 - b99) * 1e3:+.2f} ms",
    )


def print_table(rows: list[Row], footer: list[str]) -> None:
    """Print ``rows`` as one Markdown table, then the footer lines."""
    head = ("metric", "codemode runtime", "baseline", "baseline is", "vs baseline")
    body = [(r.metric, r.value, r.baseline, r.baseline_is, r.versus) for r in rows]
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


# -- the measurements ---------------------------------------------------------------------------


async def measure_latency(
    session: LocalSession, engine: NodeEngine, pid: int
) -> tuple[list[Row], float]:
    """Execute-latency rows, session and bare engine interleaved; also returns the p50 (s)."""
    progress(f"execute latency: {EXEC_SAMPLES} samples per path, warm pool")
    through_session: list[float] = []
    through_engine: list[float] = []
    pipe: list[float] = []
    for _ in range(5):  # warm both paths up
        await quiesce([pid])
        await session_latency(session)
        await quiesce([pid])
        await engine_latency(engine)
    for _ in range(EXEC_SAMPLES):
        await quiesce([pid])
        through_session.append(await session_latency(session))
        await quiesce([pid])
        through_engine.append(await engine_latency(engine))
        await quiesce([pid])
        for _ in range(PIPE_SAMPLES_PER_EXEC):
            pipe.append(await pipe_round_trip(engine))
    rows = [
        latency_row(
            "execute -> initial response, p50 / p99, ms",
            through_session,
            through_engine,
            "same cell via `NodeEngine.run_cell` to its done event (no session layer)",
        ),
        latency_row(
            "  engine `run_cell` -> done, p50 / p99, ms",
            through_engine,
            pipe,
            "frame round trip Python -> Node host -> Python (no worker)",
        ),
    ]
    return rows, percentile(through_session, 50)


async def measure_nested(session: LocalSession, pid: int) -> tuple[list[Row], float, float]:
    """Nested-call rows; also returns the sequential and parallel medians (us) for the goals."""
    progress(f"nested calls: {SEQ_CALLS} sequential, {PAR_CALLS} parallel")
    rows: list[Row] = []
    medians: list[float] = []
    for kind, calls, rounds, local_rounds, label in (
        ("seq", SEQ_CALLS, 1, LOCAL_SEQ_ROUNDS, f"{SEQ_CALLS} awaited one by one"),
        ("par", PAR_CALLS, PAR_ROUNDS, LOCAL_PAR_ROUNDS, f"{PAR_CALLS} per Promise.all"),
    ):
        samples: list[float] = []
        source = loop_source(kind, "tools.echo", calls, rounds, SETTLE_MS)
        for _ in range(CALL_CELLS):
            await quiesce([pid])
            samples.append(float(await execute(session, source, [ECHO])) * 1e3 / (calls * rounds))
        local: list[float] = []
        for _ in range(LOCAL_CELLS):
            await quiesce([pid])
            ms = float(
                await execute(
                    session, loop_source(kind, "local", calls, local_rounds, SETTLE_MS), []
                )
            )
            local.append(ms * 1e3 / (calls * local_rounds))
        median, base = statistics.median(samples), statistics.median(local)
        medians.append(median)
        digits = 1 if kind == "seq" else 2
        rows.append(
            Row(
                f"nested call, {label}, us/call" + (" (amortised)" if kind == "par" else ""),
                f"{median:.{digits}f} ({min(samples):.{digits}f}-{max(samples):.{digits}f})",
                f"{base:.2f}",
                "same loop awaiting a JS-local `async (x) => x` in the cell",
                f"{median - base:+.{digits}f} us",
            )
        )
    return rows, medians[0], medians[1]


async def measure_throughput(
    sessions: list[LocalSession], engine: NodeEngine, pid: int
) -> list[Row]:
    """Cells-per-second rows, back to back and with ``CONCURRENCY`` in flight."""
    progress(f"throughput: {RATE_CELLS} cells per run, 4 runs")
    rows: list[Row] = []
    for lanes in (1, CONCURRENCY):
        await quiesce([pid])
        through_session = await rate(
            [lambda s=s: session_latency(s) for s in sessions[:lanes]],  # type: ignore[misc]
            RATE_CELLS,
        )
        await quiesce([pid])
        through_engine = await rate([lambda: engine_done(engine)] * lanes, RATE_CELLS)
        label = "back to back" if lanes == 1 else f"{lanes} in flight ({lanes} sessions)"
        rows.append(
            Row(
                f"trivial cells per second, {label}",
                f"{through_session:.0f}",
                f"{through_engine:.0f}",
                f"same via `NodeEngine.run_cell`, {lanes} in flight",
                f"{through_session / through_engine:.2f}x",
            )
        )
    return rows


async def measure_memory(
    provider: LocalSessionProvider, delegate: CodeModeSessionDelegate, pid: int, existing: int
) -> list[Row]:
    """RSS rows: per idle session and per running (blocked) cell (``existing`` sessions open)."""
    progress(f"RSS: {IDLE_SESSIONS} idle sessions, then {BLOCKED_CELLS} blocked cells")
    await quiesce([pid])
    base = rss(pid)
    sessions = [await provider.create_session(delegate) for _ in range(IDLE_SESSIONS)]
    await quiesce([pid])
    idle = rss(pid)
    started = [
        await sessions[i].execute(ExecuteRequest("bench", BLOCKED, yield_time_ms=50))
        for i in range(BLOCKED_CELLS)
    ]
    for response in await asyncio.gather(*(cell.initial_response() for cell in started)):
        assert isinstance(response, Yielded), response
    await quiesce([pid])
    running = rss(pid)
    for i, cell in enumerate(started):
        await sessions[i].terminate(cell.cell_id)
    await quiesce([pid])
    after = rss(pid)
    # Python objects of one session, exactly (RSS hides small allocations in free pools).
    tracemalloc.start()
    traced = [await provider.create_session(delegate) for _ in range(200)]
    per_session_traced = tracemalloc.get_traced_memory()[0] / len(traced) / 1024
    tracemalloc.stop()
    del traced
    if base is None or idle is None or running is None or after is None:
        return [Row("RSS", "n/a", "n/a", "needs /proc (Linux)", "")]
    per_session = (idle.total - base.total) / IDLE_SESSIONS
    per_cell = (running.total - idle.total) / BLOCKED_CELLS / 1024
    return [
        Row(
            f"RSS per idle session, KiB ({IDLE_SESSIONS} sessions)",
            f"{per_session:+.1f} (Node {(idle.node - base.node) / IDLE_SESSIONS:+.1f},"
            f" Python {(idle.python - base.python) / IDLE_SESSIONS:+.1f};"
            f" traced Python objects {per_session_traced:.1f})",
            f"{base.total / 1024:.1f} MiB",
            f"RSS before: started provider, {WARM_WORKERS} warm workers,"
            f" {existing} sessions (Node {base.node / 1024:.1f}"
            f" + Python {base.python / 1024:.1f} MiB)",
            f"{(idle.total - base.total) / base.total * 100:+.1f}% for all {IDLE_SESSIONS}",
        ),
        Row(
            f"RSS per running cell, MiB ({BLOCKED_CELLS} blocked cells)",
            f"{per_cell:+.1f} (Node {(running.node - idle.node) / BLOCKED_CELLS / 1024:+.1f},"
            f" Python {(running.python - idle.python) / BLOCKED_CELLS / 1024:+.2f})",
            f"{idle.total / 1024:.1f} MiB",
            f"RSS before, the {IDLE_SESSIONS} sessions idle;"
            f" after terminating the cells: {after.total / 1024:.1f} MiB",
            f"{per_cell * 1024 / idle.total * 100:+.1f}% each",
        ),
    ]


def _verdict(value: float, goal: float) -> str:
    return "met" if value <= goal else "NOT met"


def _node_version() -> str:
    try:
        found = subprocess.run(
            [find_node(), "--version"], capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "node ?"
    return "node " + found.stdout.strip()


async def run() -> None:
    """Measure everything on one provider (closed before printing) and print the table."""
    delegate = EchoDelegate()
    provider = LocalSessionProvider(warm_workers=WARM_WORKERS)
    began = time.perf_counter()
    try:
        sessions = [await provider.create_session(delegate) for _ in range(CONCURRENCY)]
        engine = provider.engine
        transport = engine._transport
        assert transport is not None
        pid = transport.get_pid()
        memory = await measure_memory(provider, delegate, pid, len(sessions))
        latency, p50 = await measure_latency(sessions[0], engine, pid)
        nested, seq, par = await measure_nested(sessions[0], pid)
        throughput = await measure_throughput(sessions, engine, pid)
    finally:
        await provider.aclose()
    progress(f"done in {time.perf_counter() - began:.0f} s")
    print_table(
        [*latency, *nested, *throughput, *memory],
        [
            f"Goals (runtime issue), {_node_version()}, Python {platform.python_version()},"
            f" {os.cpu_count()} CPUs:",
            f"- trivial execute p50 <= {GOAL_EXEC_P50_MS:g} ms: {p50 * 1e3:.2f} ms"
            f" -- {_verdict(p50 * 1e3, GOAL_EXEC_P50_MS)}",
            f"- nested call, sequential <= {GOAL_SEQ_US:g} us: {seq:.1f} us"
            f" -- {_verdict(seq, GOAL_SEQ_US)}",
            f"- nested call, 1,000 parallel <= {GOAL_PAR_US:g} us amortised: {par:.2f} us"
            f" -- {_verdict(par, GOAL_PAR_US)}",
            f"Execute: {EXEC_SAMPLES} samples per path, each after the engine went idle (pool"
            " refilled). Nested calls: timed inside the cell with Date.now() after a"
            f" {SETTLE_MS} ms settle; median (min-max) of {CALL_CELLS} cells"
            f" ({PAR_ROUNDS} Promise.all rounds per parallel cell).",
        ],
    )


def main() -> None:
    """Run the benchmark and print one table."""
    asyncio.run(run())


if __name__ == "__main__":
    main()
