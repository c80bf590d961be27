"""The embedded runtime's latency, nested-call, throughput and memory figures beside baselines.

Run: ``python -m benchmarks.runtime`` from the repository root (about 60 s on 2 cores). Prints one
Markdown table; every figure comes from :class:`LocalSession` (the public embedded session: an
engine process of its own per session, a bare V8 isolate per cell) and stands beside a baseline
measured in the same run, on the same engine process where there is one:

* execute -> initial response of ``text("hi")``, p50/p99, each sample after the engines went idle:
  beside the same source run by ``NodeEngine.run_cell`` with a minimal event sink (no session
  layer), which in turn stands beside a bare Python -> Node -> Python frame round trip (a
  ``terminate`` for an unknown cell, answered by the host at once; no isolate involved);
* the same execute back to back (the next one as soon as the last answered) and paced (10 ms
  apart): beside the same pacing through ``run_cell``;
* nested calls to a delegate whose ``invoke_tool`` returns at once, 500 awaited one by one and
  1,000 per ``Promise.all``, timed inside the cell: beside the same loops awaiting a JS-local
  ``async`` function, and the sequential call beside the raw Python -> engine process -> Python
  round trip (the ``terminate`` frame above) taken back to back, interleaved with the cells (the
  hot-path issue's goal: <= 1.5x), and the CPU time per call of this process and of the engine
  (``/proc/PID/task/*/schedstat``) beside the same per raw round trip;
* the same nested calls through a :class:`~codemode.model.ToolRegistry` (the delegate of
  ``CodeMode`` and ``codemode run --tools``), one sync and one async tool, interleaved with the
  bare delegate on sessions of the same provider (goal: <= 1.2x the bare delegate);
* trivial cells per second, 1 session back to back and 4 and 16 sessions in flight: beside the same
  through ``run_cell`` on the same engines;
* RSS (``/proc/PID/statm``) per session for 1, 4 and 8 open sessions that each ran one cell: the
  sum of their engine processes / N (and what this process grew by), beside an idle bare ``node``
  process of the same binary; per running cell (blocked on ``await new Promise(() => {})``):
  beside the engine's RSS before.

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
from functools import partial
from pathlib import Path
from typing import Final

from benchmarks.common import (
    loop_source,
    only_text,
    percentile,
    progress,
    quiesce,
    run_on_loop,
)
from codemode.model import ToolRegistry
from codemode.model.worker_pool import shared_pool
from codemode.protocol import (
    JSON,
    CodeModeNestedToolCall,
    CodeModeToolKind,
    ContentItem,
    ExecuteRequest,
    ToolDefinition,
    ToolName,
    Yielded,
)
from codemode.runtime import LocalSession, LocalSessionProvider, NodeEngine, find_node
from codemode.session import (
    CancellationToken,
    CodeModeSessionDelegate,
)

TRIVIAL: Final = 'text("hi")'
BLOCKED: Final = "await new Promise(() => {});"
#: What a session with no tools and an empty store sends the engine (``LocalSession._config``).
EMPTY_CONFIG: Final = '{"tools":[],"all":[],"store":true}'
EXEC_SAMPLES: Final = 150
PIPE_SAMPLES_PER_EXEC: Final = 6
PACED_SAMPLES: Final = 120  # per path and pacing, in 2 alternating blocks
PACE_S: Final = 0.010
SEQ_CALLS: Final = 500
PINGS: Final = 500  # raw engine round trips back to back, per sample
PAR_CALLS: Final = 1000
PAR_ROUNDS: Final = 3  # Promise.all rounds per cell, so that Date.now() (1 ms) is precise enough
CALL_CELLS: Final = 7  # cells per nested-call figure: median (and range) reported
LOCAL_SEQ_ROUNDS: Final = 1000  # the JS-local loops are cheap: repeat them so 1 ms ticks vanish
LOCAL_PAR_ROUNDS: Final = 100
LOCAL_CELLS: Final = 3
SETTLE_MS: Final = 50  # a cell waits this long before timing, so start-up work is over
RATE_CELLS: Final = 80
LANES: Final = (1, 4, 16)  # sessions with a cell in flight, for cells per second
SESSION_COUNTS: Final = (1, 4, 8)
PYTHON_SESSIONS: Final = 200  # sessions whose Python objects tracemalloc weighs (shared engine)
BLOCKED_CELLS: Final = 16
STORE_MIB: Final = 64  # a large store: this many values of 1 Mi characters
STORE_SAMPLES: Final = 40
WARM_ENGINES: Final = 1  # LocalSessionProvider's default pool
#: No session gives its engine back during the run (the default is 30 s without a cell).
IDLE_ENGINE_TIMEOUT: Final = 3600.0

GOAL_EXEC_P50_MS: Final = 5.0
GOAL_SEQ_US: Final = 100.0
GOAL_PAR_US: Final = 20.0
GOAL_SEQ_VS_PING: Final = 1.5  # hot-path issue: sequential nested call / raw engine round trip
GOAL_REGISTRY: Final = 1.2  # hot-path issue: through the registry / bare delegate

ECHO: Final = ToolDefinition("echo", ToolName.plain("echo"), "Echo", CodeModeToolKind.FUNCTION)
_PAGE_KIB: Final = (os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096) // 1024


# -- measuring aids -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Statm:
    """Resident memory of one process in KiB (``/proc/PID/statm``): all of it, and file-backed."""

    resident: int
    shared: int

    @property
    def private(self) -> int:
        """Resident minus file-backed (the binary's text and libraries are shared): KiB."""
        return self.resident - self.shared


def statm(pid: int) -> Statm | None:
    """The resident and shared sizes of ``pid`` in KiB, or None off Linux (or once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return None
    return Statm(int(fields[1]) * _PAGE_KIB, int(fields[2]) * _PAGE_KIB)


def engine_pid(session: LocalSession) -> int:
    """The process id of ``session``'s engine (which must be running)."""
    engine = session.engine
    assert engine is not None and engine.pid is not None, "the session has no running engine"
    return engine.pid


def engine_of(session: LocalSession) -> NodeEngine:
    """``session``'s engine (which must exist)."""
    assert session.engine is not None, "the session has no engine"
    return session.engine


async def settle(provider: LocalSessionProvider, pids: list[int]) -> None:
    """Wait until the pool's spare engine is up and ``pids`` (and the spare) use no CPU."""
    refill = provider.pool._refill
    if refill is not None and not refill.done():
        await asyncio.wait([refill])
    spare = [e.pid for e in provider.pool._ready if e.pid is not None]
    await quiesce([*pids, *spare])


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

    def on_call(
        self, call_id: str, tool: int, input_json: str | None, strings: dict[str, str] | None = None
    ) -> None:
        """Not expected: baseline cells call no tools."""
        raise AssertionError("unexpected nested call")

    def on_notify(self, text: str) -> None:
        """Ignored."""

    def on_yield(self, turn: int) -> None:
        """Ignored."""

    def on_done(
        self,
        error: str | None,
        writes: list[tuple[str, str]],
        call: tuple[int, int, int] | None,
    ) -> None:
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
    """Seconds for one frame Python -> Node host -> Python (no isolate involved).

    A ``terminate`` for a cell the host does not know is answered at once with ``exited``.
    """
    key = next(_ping_keys)
    sink = Sink()
    engine._cells[key] = sink
    start = time.perf_counter()
    engine._send({"t": "terminate", "cell": key})
    await sink.exited
    return time.perf_counter() - start


def cpu_ns(pid: int) -> int | None:
    """CPU time (ns) used so far by every thread of ``pid`` (``schedstat``; None off Linux)."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with open(task / "schedstat", "rb") as stat:
                total += int(stat.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total


async def pings(engine: NodeEngine, count: int) -> float:
    """Microseconds per raw engine round trip, ``count`` of them back to back."""
    start = time.perf_counter()
    for _ in range(count):
        await pipe_round_trip(engine)
    return (time.perf_counter() - start) / count * 1e6


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


async def bare_node() -> Statm | None:
    """The RSS of an idle ``node``: same binary; no host.js, addon or confinement."""
    child = await asyncio.create_subprocess_exec(
        find_node(), "-e", "setInterval(() => {}, 1 << 30);", stdin=subprocess.DEVNULL
    )
    try:
        await asyncio.sleep(0.3)
        await quiesce([child.pid])
        return statm(child.pid)
    finally:
        child.kill()
        await child.wait()


# -- the session side ---------------------------------------------------------------------------


class EchoDelegate(CodeModeSessionDelegate):
    """Serves ``echo``: returns its input at once."""

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        """Return the input unchanged."""
        return invocation.input


def echo_registry() -> ToolRegistry:
    """A registry with the echo tool three times: a sync function (in a worker thread, and
    ``inline`` on the loop) and an async one (typed arguments)."""
    registry = ToolRegistry()

    @registry.tool
    def echo_sync(i: int) -> dict[str, int]:
        """Echo, as a plain function (the registry runs it in a worker thread)."""
        return {"i": i}

    @registry.tool(inline=True)
    def echo_inline(i: int) -> dict[str, int]:
        """Echo, as a plain function run on the event loop."""
        return {"i": i}

    @registry.tool
    async def echo_async(i: int) -> dict[str, int]:
        """Echo, as a coroutine function."""
        return {"i": i}

    return registry


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


def _mib(kib: float) -> str:
    return f"{kib / 1024:.1f}"


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
    session: LocalSession, provider: LocalSessionProvider
) -> tuple[list[Row], float]:
    """Execute-latency rows, session and bare engine interleaved; also returns the p50 (s)."""
    progress(f"execute latency: {EXEC_SAMPLES} samples per path, engines idle")
    engine, pids = engine_of(session), [engine_pid(session)]
    await settle(provider, pids)
    through_session: list[float] = []
    through_engine: list[float] = []
    pipe: list[float] = []
    for _ in range(5):  # warm both paths up
        await quiesce(pids)
        await session_latency(session)
        await quiesce(pids)
        await engine_latency(engine)
    for _ in range(EXEC_SAMPLES):
        await quiesce(pids)
        through_session.append(await session_latency(session))
        await quiesce(pids)
        through_engine.append(await engine_latency(engine))
        await quiesce(pids)
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
            "frame round trip Python -> Node host -> Python (no isolate)",
        ),
    ]
    return rows, percentile(through_session, 50)


async def measure_paced(session: LocalSession, provider: LocalSessionProvider) -> list[Row]:
    """Execute-latency rows back to back and 10 ms apart, beside the same through ``run_cell``."""
    progress(f"execute latency back to back and {PACE_S * 1e3:g} ms apart: {PACED_SAMPLES} each")
    engine = engine_of(session)
    rows: list[Row] = []
    for pause, label in ((0.0, "back to back"), (PACE_S, f"{PACE_S * 1e3:g} ms apart")):
        through_session: list[float] = []
        through_engine: list[float] = []
        for _ in range(2):  # alternating blocks, so that drift in the load hits both paths
            paths: tuple[tuple[list[float], Callable[[], Awaitable[float]]], ...] = (
                (through_session, partial(session_latency, session)),
                (through_engine, partial(engine_latency, engine)),
            )
            for samples, one in paths:
                await settle(provider, [engine_pid(session)])
                for _ in range(PACED_SAMPLES // 2):
                    samples.append(await one())
                    if pause:
                        await asyncio.sleep(pause)
        rows.append(
            latency_row(
                f"execute -> initial response, {label}, p50 / p99, ms",
                through_session,
                through_engine,
                f"same via `NodeEngine.run_cell`, {label}",
            )
        )
    return rows


async def measure_nested(
    session: LocalSession, provider: LocalSessionProvider
) -> tuple[list[Row], float, float, float]:
    """Nested-call rows; also returns the sequential and parallel medians (us) for the goals,
    and the median raw engine round trip, back to back (us)."""
    progress(f"nested calls: {SEQ_CALLS} sequential, {PAR_CALLS} parallel")
    engine, pids = engine_of(session), [engine_pid(session)]
    await settle(provider, pids)
    rows: list[Row] = []
    medians: list[float] = []
    ping_samples: list[float] = []
    # CPU (us) per call of this process and of the engine, for each sequential cell and ping run.
    cpu_seq: list[tuple[float, float]] = []
    cpu_ping: list[tuple[float, float]] = []
    for kind, calls, rounds, local_rounds, label in (
        ("seq", SEQ_CALLS, 1, LOCAL_SEQ_ROUNDS, f"{SEQ_CALLS} awaited one by one"),
        ("par", PAR_CALLS, PAR_ROUNDS, LOCAL_PAR_ROUNDS, f"{PAR_CALLS} per Promise.all"),
    ):
        samples: list[float] = []
        source = loop_source(kind, "tools.echo", calls, rounds, SETTLE_MS)
        for _ in range(CALL_CELLS):
            await quiesce(pids)
            here, there = cpu_ns(os.getpid()), cpu_ns(pids[0])
            samples.append(float(await execute(session, source, [ECHO])) * 1e3 / (calls * rounds))
            if kind == "seq" and here is not None and there is not None:
                cpu_seq.append(_per_call(here, there, pids[0], calls))
            if kind == "seq":
                await quiesce(pids)
                here, there = cpu_ns(os.getpid()), cpu_ns(pids[0])
                ping_samples.append(await pings(engine, PINGS))
                if here is not None and there is not None:
                    cpu_ping.append(_per_call(here, there, pids[0], PINGS))
        local: list[float] = []
        for _ in range(LOCAL_CELLS):
            await quiesce(pids)
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
        if kind == "seq":
            ping = statistics.median(ping_samples)
            rows.append(
                Row(
                    f"  nested call, {label}, us/call, beside the raw engine round trip",
                    f"{median:.1f}",
                    f"{ping:.1f} ({min(ping_samples):.1f}-{max(ping_samples):.1f})",
                    f"Python -> engine process -> Python frame round trip, {PINGS} back to back"
                    " (median of as many samples, interleaved with the cells)",
                    f"{median / ping:.2f}x",
                )
            )
            if cpu_seq and cpu_ping:
                python = statistics.median(c[0] for c in cpu_seq)
                node = statistics.median(c[1] for c in cpu_seq)
                python_ping = statistics.median(c[0] for c in cpu_ping)
                node_ping = statistics.median(c[1] for c in cpu_ping)
                rows.append(
                    Row(
                        "  CPU per sequential nested call, Python / engine process, us",
                        f"{python:.1f} / {node:.1f}",
                        f"{python_ping:.1f} / {node_ping:.1f}",
                        "same per raw engine round trip (schedstat of every thread, this process"
                        " includes the benchmark's own loop)",
                        f"{python - python_ping:+.1f} / {node - node_ping:+.1f} us",
                    )
                )
    return rows, medians[0], medians[1], statistics.median(ping_samples)


def _per_call(here: int, there: int, pid: int, calls: int) -> tuple[float, float]:
    """CPU (us) per call of this process and of ``pid`` since ``here`` / ``there``."""
    now_here, now_there = cpu_ns(os.getpid()), cpu_ns(pid)
    assert now_here is not None and now_there is not None
    return (now_here - here) / calls / 1e3, (now_there - there) / calls / 1e3


async def measure_registry(
    session: LocalSession, provider: LocalSessionProvider
) -> tuple[list[Row], list[float]]:
    """Nested calls through a ``ToolRegistry`` (sync and async tool) beside the bare delegate.

    The registry serves a session of its own (an engine of its own, from the same pool); its
    cells alternate with the bare delegate's. Also returns the ratios for the goal.
    """
    progress("nested calls through ToolRegistry: sync and async tool beside the bare delegate")
    registry = echo_registry()
    served = await provider.create_session(registry)
    try:
        assert await execute(served, TRIVIAL, []) == "hi"
        pids = [engine_pid(session), engine_pid(served)]
        await settle(provider, pids)
        rows: list[Row] = []
        ratios: list[float] = []
        tools = registry.definitions()
        for kind, calls, rounds, label in (
            ("seq", SEQ_CALLS, 1, f"{SEQ_CALLS} awaited one by one"),
            ("par", PAR_CALLS, PAR_ROUNDS, f"{PAR_CALLS} per Promise.all"),
        ):
            bare: list[float] = []
            through: dict[str, list[float]] = {"echo_sync": [], "echo_inline": [], "echo_async": []}
            for _ in range(CALL_CELLS):
                await quiesce(pids)
                source = loop_source(kind, "tools.echo", calls, rounds, SETTLE_MS)
                bare.append(float(await execute(session, source, [ECHO])) * 1e3 / (calls * rounds))
                for name, samples in through.items():
                    await quiesce(pids)
                    source = loop_source(kind, f"tools.{name}", calls, rounds, SETTLE_MS)
                    ms = float(await execute(served, source, tools))
                    samples.append(ms * 1e3 / (calls * rounds))
            base = statistics.median(bare)
            digits = 1 if kind == "seq" else 2
            if kind == "seq":
                rows.append(await thread_hop_floor(through["echo_sync"], base, calls, pids))
            for name, samples in through.items():
                median = statistics.median(samples)
                ratios.append(median / base)
                flavour = {"echo_sync": "sync", "echo_inline": "sync inline"}.get(name, "async")
                rows.append(
                    Row(
                        f"  through `ToolRegistry`, {flavour} tool, {label}, us/call",
                        f"{median:.{digits}f} ({min(samples):.{digits}f}-{max(samples):.{digits}f})",
                        f"{base:.{digits}f} ({min(bare):.{digits}f}-{max(bare):.{digits}f})",
                        "the bare delegate (`invoke_tool` returns its input), cells interleaved",
                        f"{median / base:.2f}x",
                    )
                )
        return rows, ratios
    finally:
        await served.shutdown()


async def thread_hop_floor(sync: list[float], base: float, calls: int, pids: list[int]) -> Row:
    """The floor of what a sync tool adds to a sequential call: one hop from the event loop to
    the registry's worker thread and back (``WorkerPool.run`` of a no-op, awaited one by one in
    this process), beside what the sync tool added over the bare delegate in the same run."""
    pool = shared_pool()
    samples: list[float] = []
    for _ in range(CALL_CELLS):
        await quiesce(pids)
        started = time.perf_counter()
        for _ in range(calls):
            await pool.run(int)
        samples.append((time.perf_counter() - started) * 1e6 / calls)
    hop = statistics.median(samples)
    added = statistics.median(sync) - base
    return Row(
        f"  floor: event loop -> sync-tool worker thread -> loop, {calls} awaited one by one, us",
        f"{hop:.1f} ({min(samples):.1f}-{max(samples):.1f})",
        f"{added:.1f}",
        "what the sync tool added to the bare delegate's call (same run)",
        f"{hop / added:.2f}x" if added > 0 else "n/a",
    )


async def measure_throughput(
    sessions: list[LocalSession], provider: LocalSessionProvider
) -> list[Row]:
    """Cells-per-second rows: 1 session back to back, then each of ``LANES`` sessions in flight."""
    progress(f"throughput: {RATE_CELLS} cells per run, {2 * len(LANES)} runs")
    pids = [engine_pid(s) for s in sessions]
    rows: list[Row] = []
    for lanes in LANES:
        chosen = sessions[:lanes]
        await settle(provider, pids)
        through_session = await rate([partial(session_latency, s) for s in chosen], RATE_CELLS)
        await settle(provider, pids)
        through_engine = await rate(
            [partial(engine_done, engine_of(s)) for s in chosen], RATE_CELLS
        )
        label = "1 session back to back" if lanes == 1 else f"{lanes} sessions in flight"
        rows.append(
            Row(
                f"trivial cells per second, {label}",
                f"{through_session:.0f}",
                f"{through_engine:.0f}",
                f"same via `NodeEngine.run_cell` on the same {lanes} engine(s)",
                f"{through_session / through_engine:.2f}x",
            )
        )
    return rows


async def measure_sessions(
    provider: LocalSessionProvider, delegate: CodeModeSessionDelegate, pids: list[int]
) -> tuple[list[Row], dict[int, float]]:
    """RSS per session for ``SESSION_COUNTS`` open sessions, each of which ran one cell.

    Also returns the resident KiB per session by count (for the footer). ``pids``: the engines of
    the sessions already open (kept idle meanwhile).
    """
    progress(f"RSS per session: {', '.join(map(str, SESSION_COUNTS))} sessions")
    bare = await bare_node()
    await settle(provider, pids)
    spare = [statm(e.pid) for e in provider.pool._ready if e.pid is not None]
    rows: list[Row] = []
    per_session: dict[int, float] = {}
    for count in SESSION_COUNTS:
        await settle(provider, pids)
        python_before = statm(os.getpid())
        opened = [await provider.create_session(delegate) for _ in range(count)]
        for session in opened:
            assert await execute(session, TRIVIAL, []) == "hi"
        engines = [engine_pid(s) for s in opened]
        await settle(provider, [*pids, *engines])
        sizes = [statm(pid) for pid in engines]
        python_after = statm(os.getpid())
        await asyncio.gather(*(s.shutdown() for s in opened))
        if bare is None or python_before is None or python_after is None or None in sizes:
            return [Row("RSS per session", "n/a", "n/a", "needs /proc (Linux)", "")], {}
        resident = sum(s.resident for s in sizes if s is not None) / count
        private = sum(s.private for s in sizes if s is not None) / count
        python = (python_after.resident - python_before.resident) / count
        per_session[count] = resident
        rows.append(
            Row(
                f"RSS per session, {count} session{'s' if count > 1 else ''} that ran a cell, MiB",
                f"{_mib(resident)} (private {_mib(private)}; Python {python:+.0f} KiB)",
                f"{_mib(bare.resident)} (private {_mib(bare.private)})",
                "an idle bare `node` process, same binary (no host.js, addon or confinement)",
                f"{resident / bare.resident:.2f}x (private {private / bare.private:.2f}x)",
            )
        )
    if bare is not None and spare and spare[0] is not None:
        rows.append(
            Row(
                "  RSS of the pool's spare engine (started, no cell yet), MiB",
                f"{_mib(spare[0].resident)} (private {_mib(spare[0].private)})",
                f"{_mib(bare.resident)} (private {_mib(bare.private)})",
                "same bare `node` process",
                f"{spare[0].resident / bare.resident:.2f}x",
            )
        )
    # Python objects of one session, exactly (RSS hides small allocations in free pools); the
    # engine is shared here so that the figure holds the session alone.
    shared = LocalSessionProvider(shared_engine=True)
    try:
        await shared.warm()
        tracemalloc.start()
        traced = [await shared.create_session(delegate) for _ in range(PYTHON_SESSIONS)]
        per_session_traced = tracemalloc.get_traced_memory()[0] / len(traced) / 1024
        tracemalloc.stop()
        del traced
    finally:
        await shared.aclose()
    python_now = statm(os.getpid())
    rows.append(
        Row(
            "  Python objects per session, KiB (tracemalloc)",
            f"{per_session_traced:.1f}",
            "-" if python_now is None else f"{_mib(python_now.resident)} MiB",
            "this process's RSS",
            "",
        )
    )
    return rows, per_session


async def measure_blocked(provider: LocalSessionProvider, delegate: CodeModeSessionDelegate) -> Row:
    """RSS per running (blocked) cell, ``BLOCKED_CELLS`` of them in one fresh session."""
    progress(f"RSS per running cell: {BLOCKED_CELLS} blocked cells in one session")
    session = await provider.create_session(delegate)
    try:
        assert await execute(session, TRIVIAL, []) == "hi"
        pid = engine_pid(session)
        await settle(provider, [pid])
        before = statm(pid)
        started = [
            await session.execute(ExecuteRequest("bench", BLOCKED, yield_time_ms=50))
            for _ in range(BLOCKED_CELLS)
        ]
        for response in await asyncio.gather(*(cell.initial_response() for cell in started)):
            assert isinstance(response, Yielded), response
        await quiesce([pid])
        running = statm(pid)
        for cell in started:
            await session.terminate(cell.cell_id)
        await quiesce([pid])
        after = statm(pid)
    finally:
        await session.shutdown()
    if before is None or running is None or after is None:
        return Row("RSS per running cell", "n/a", "n/a", "needs /proc (Linux)", "")
    per_cell = (running.resident - before.resident) / BLOCKED_CELLS
    private = (running.private - before.private) / BLOCKED_CELLS
    return Row(
        f"RSS per running cell, MiB ({BLOCKED_CELLS} blocked cells, one session)",
        f"{per_cell / 1024:+.1f} (private {private / 1024:+.1f})",
        f"{_mib(before.resident)}",
        "the session's engine before (one cell run);"
        f" after terminating the cells: {_mib(after.resident)} MiB",
        f"{per_cell / before.resident * 100:+.1f}% each",
    )


async def measure_store(provider: LocalSessionProvider, delegate: CodeModeSessionDelegate) -> Row:
    """The trivial execute in a session with a large store, beside one with an empty store."""
    progress(f"execute with a {STORE_MIB} Mi-character store: {STORE_SAMPLES} samples per path")
    full = await provider.create_session(delegate)
    empty = await provider.create_session(delegate)
    try:
        half = STORE_MIB // 2
        for first in (0, half):
            source = (
                f"for (let i = {first}; i < {first + half}; i++)"
                " store('k' + i, 'x'.repeat(1024 * 1024)); text('hi')"
            )
            assert await execute(full, source, []) == "hi"
        pids = [engine_pid(full), engine_pid(empty)]
        await settle(provider, pids)
        with_store: list[float] = []
        without: list[float] = []
        for _ in range(STORE_SAMPLES):
            await quiesce(pids)
            with_store.append(await session_latency(full))
            await quiesce(pids)
            without.append(await session_latency(empty))
    finally:
        await full.shutdown()
        await empty.shutdown()
    return latency_row(
        f"execute -> initial response, {STORE_MIB} Mi-character store, p50 / p99, ms",
        with_store,
        without,
        "the same cell in a session with an empty store",
    )


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


def _confinement() -> str:
    from codemode.runtime import confinement

    return confinement.probe().describe()


async def run() -> None:
    """Measure everything on one provider (closed before printing) and print the table."""
    delegate = EchoDelegate()
    provider = LocalSessionProvider(
        warm_engines=WARM_ENGINES, idle_engine_timeout=IDLE_ENGINE_TIMEOUT
    )
    began = time.perf_counter()
    try:
        sessions = [await provider.create_session(delegate) for _ in range(max(LANES))]
        for session in sessions:
            assert await execute(session, TRIVIAL, []) == "hi"
        pids = [engine_pid(s) for s in sessions]
        memory, per_session = await measure_sessions(provider, delegate, pids)
        blocked = await measure_blocked(provider, delegate)
        store = await measure_store(provider, delegate)
        latency, p50 = await measure_latency(sessions[0], provider)
        paced = await measure_paced(sessions[0], provider)
        nested, seq, par, ping = await measure_nested(sessions[0], provider)
        registry, registry_ratios = await measure_registry(sessions[0], provider)
        throughput = await measure_throughput(sessions, provider)
    finally:
        await provider.aclose()
    progress(f"done in {time.perf_counter() - began:.0f} s")
    python = statm(os.getpid())
    print_table(
        [*latency, store, *paced, *nested, *registry, *throughput, *memory, blocked],
        [
            f"Goals (runtime issue), {_node_version()}, Python {platform.python_version()},"
            f" {os.cpu_count()} CPUs; {_confinement()}:",
            f"- trivial execute p50 <= {GOAL_EXEC_P50_MS:g} ms: {p50 * 1e3:.2f} ms"
            f" -- {_verdict(p50 * 1e3, GOAL_EXEC_P50_MS)}",
            f"- nested call, sequential <= {GOAL_SEQ_US:g} us: {seq:.1f} us"
            f" -- {_verdict(seq, GOAL_SEQ_US)}",
            f"- nested call, 1,000 parallel <= {GOAL_PAR_US:g} us amortised: {par:.2f} us"
            f" -- {_verdict(par, GOAL_PAR_US)}",
            f"Goals (hot-path issue): sequential nested call <= {GOAL_SEQ_VS_PING:g}x the raw"
            f" engine round trip: {seq:.1f} / {ping:.1f} us = {seq / ping:.2f}x"
            f" -- {_verdict(seq / ping, GOAL_SEQ_VS_PING)};"
            f" through the registry <= {GOAL_REGISTRY:g}x the bare delegate:"
            f" {', '.join(f'{r:.2f}x' for r in registry_ratios)} (sync, sync inline, async:"
            " sequential, then parallel) --"
            f" {_verdict(max(registry_ratios[1:3] + registry_ratios[4:]), GOAL_REGISTRY)}"
            " for inline and async tools (a sync tool in a worker thread pays the thread hop)",
            "RSS per session (engine resident / sessions, MiB): "
            + ", ".join(f"{n}: {kib / 1024:.1f}" for n, kib in per_session.items())
            + ("" if python is None else f"; this Python process: {_mib(python.resident)} MiB")
            + f"; the provider also keeps {WARM_ENGINES} spare engine(s) warm.",
            f"Execute: {EXEC_SAMPLES} samples per path, each after the engine went idle;"
            f" back to back / paced: {PACED_SAMPLES} per path in 2 alternating blocks."
            " Nested calls: timed inside the cell with Date.now() after a"
            f" {SETTLE_MS} ms settle; median (min-max) of {CALL_CELLS} cells"
            f" ({PAR_ROUNDS} Promise.all rounds per parallel cell).",
        ],
    )


def main() -> None:
    """Run the benchmark (``--loop asyncio|uvloop``) and print one table."""
    run_on_loop(run, __doc__)


if __name__ == "__main__":
    main()
