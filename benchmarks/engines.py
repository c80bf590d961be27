"""Measure candidate V8 engines for codemode cells, side by side.

Run as ``python benchmarks/engines.py``. Candidates that are not installed are
skipped with the reason printed. Needs (PyPI): ``mini-racer`` for that column;
the ``codemode`` column is the shipped engine (:class:`codemode.runtime.NodeEngine`:
a confined Node.js process, a bare ``isolated-vm`` isolate per cell). Prints one
table; see docs/decisions/0002-js-engine.md (which measured the retired worker
prototype in the same way).

Every "cell" column is the path a real cell would take (fresh isolate per cell,
nested calls through the Python asyncio loop); the "bare" column is the same
JavaScript evaluated in an already existing context with no cell machinery
(for nested calls: the same loop awaiting a local JS async function; for the
codemode engine, whose host evaluates nothing outside a cell, "bare eval" is a
frame round trip Python -> engine host -> Python).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

import msgspec

from codemode.runtime import NodeEngine, find_node
from codemode.runtime.isolated_vm import VERSION as ISOLATED_VM_VERSION

TRIVIAL_SRC = "const x = 1 + 1;"
SEQ_CALLS = 300
PAR_CALLS = 1000
EXEC_RUNS = 60
HEAP_LIMIT_MB = 32
HEAP_BOMB_SRC = "const a = []; while (true) { a.push(new Array(1000).fill(1)); }"
# memory outside the JS heap: is it counted against the limit?
ARRAYBUFFER_SRC = "const big = new Uint8Array(256 * 1024 * 1024); big.fill(1);"


def seq_src(tool: str) -> str:
    return f"let s = 0; for (let i = 0; i < {SEQ_CALLS}; i++) {{ s += await {tool}(i); }}"


def par_src(tool: str) -> str:
    return (
        f"const ps = []; for (let i = 0; i < {PAR_CALLS}; i++) {{ ps.push({tool}(i)); }}"
        " await Promise.all(ps);"
    )


LOCAL_TOOL = "const local = async (v) => v;"
BARE_CALLS = 100_000  # the bare loops are cheap: run many so fixed costs vanish


def bare_seq_src() -> str:
    return LOCAL_TOOL + seq_src("local").replace(str(SEQ_CALLS), str(BARE_CALLS))


def bare_par_src() -> str:
    return LOCAL_TOOL + par_src("local").replace(str(PAR_CALLS), str(BARE_CALLS))


# ---------------------------------------------------------------------------------
# results and reporting


@dataclass
class Metrics:
    """One engine's measurements (None = not measured)."""

    name: str
    version: str = ""
    create_ms: float | None = None
    exec_p50_ms: float | None = None
    exec_p99_ms: float | None = None
    bare_p50_ms: float | None = None
    bare_p99_ms: float | None = None
    seq_us: float | None = None
    bare_seq_us: float | None = None
    par_us: float | None = None
    bare_par_us: float | None = None
    terminate_ms: float | None = None
    loop_lag_ms: float | None = None
    heap_outcome: str = ""
    arraybuffer_outcome: str = ""
    notes: list[str] = field(default_factory=list)


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(results: list[Metrics]) -> None:
    rows: list[tuple[str, Callable[[Metrics], str]]] = [
        ("version", lambda m: m.version),
        ("fresh isolate create, ms (p50)", lambda m: fmt(m.create_ms)),
        ("trivial execute -> result p50, ms", lambda m: fmt(m.exec_p50_ms, 3)),
        ("trivial execute -> result p99, ms", lambda m: fmt(m.exec_p99_ms, 3)),
        ("  bare eval p50, ms", lambda m: fmt(m.bare_p50_ms, 3)),
        ("  bare eval p99, ms", lambda m: fmt(m.bare_p99_ms, 3)),
        (f"nested call sequential, us ({SEQ_CALLS})", lambda m: fmt(m.seq_us, 1)),
        ("  bare (JS-local async fn), us", lambda m: fmt(m.bare_seq_us, 2)),
        (f"nested call {PAR_CALLS} parallel, us/call", lambda m: fmt(m.par_us, 1)),
        ("  bare (JS-local async fn), us/call", lambda m: fmt(m.bare_par_us, 2)),
        ("terminate while(true){} -> stopped, ms", lambda m: fmt(m.terminate_ms, 2)),
        ("asyncio max lag, cell spins after a call, ms", lambda m: fmt(m.loop_lag_ms, 1)),
        (f"heap bomb, limit {HEAP_LIMIT_MB} MiB", lambda m: m.heap_outcome),
        ("256 MiB typed array, same limit", lambda m: m.arraybuffer_outcome),
    ]
    head = ["metric", *(m.name for m in results)]
    body = [[label, *(get(m) for m in results)] for label, get in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    line = "+".join("-" * (w + 2) for w in widths)
    print()
    print(" | ".join(c.ljust(w) for c, w in zip(head, widths, strict=True)))
    print(line)
    for r in body:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    for m in results:
        for note in m.notes:
            print(f"note [{m.name}]: {note}")


async def loop_lag_during(task: Awaitable[Any], seconds: float) -> float:
    """Max extra delay of 5 ms sleeps on this loop while `task` runs, in ms."""
    del task  # the task runs concurrently; we only sample the loop
    worst = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        await asyncio.sleep(0.005)
        worst = max(worst, time.perf_counter() - start - 0.005)
    return worst * 1e3


def optional_module(name: str) -> ModuleType | str:
    """The module, or why it cannot be used."""
    if importlib.util.find_spec(name) is None:
        return f"python module {name!r} not installed"
    try:
        return importlib.import_module(name)
    except Exception as exc:
        return f"import {name} failed: {exc!r}"


# ---------------------------------------------------------------------------------
# candidate 1: mini-racer (in process)


class MiniRacerBench:
    """mini-racer: one MiniRacer context (= V8 isolate + its own thread) per cell."""

    def __init__(self, mod: ModuleType) -> None:
        self.mod = mod
        self.loop = asyncio.get_running_loop()
        self.stack = contextlib.ExitStack()

    def context(self) -> Any:
        return self.stack.enter_context(self.mod.mini_racer(self.loop))

    async def run_cell(self, mr: Any, src: str) -> None:
        """A cell: strict async wrapper (mini-racer has no module evaluation API)."""
        promise = await mr.eval_cancelable(f'(async () => {{ "use strict"; {src}\n}})()')
        await promise

    async def measure(self) -> Metrics:
        m = Metrics("mini-racer")
        try:
            return await self._measure(m)
        finally:
            self.stack.close()

    async def _measure(self, m: Metrics) -> Metrics:
        first = self.context()
        m.version = f"{importlib.metadata.version('mini-racer')} / V8 {first.v8_version}"

        creates: list[float] = []
        for _ in range(30):
            start = time.perf_counter()
            with self.mod.mini_racer(self.loop):
                creates.append(time.perf_counter() - start)
        m.create_ms = statistics.median(creates) * 1e3

        # execute: pre-created context per cell (warm pool), fresh isolate each time
        samples: list[float] = []
        for _ in range(EXEC_RUNS // 20):
            with contextlib.ExitStack() as batch:
                pool = [batch.enter_context(self.mod.mini_racer(self.loop)) for _ in range(20)]
                for mr in pool:
                    start = time.perf_counter()
                    await self.run_cell(mr, TRIVIAL_SRC)
                    samples.append(time.perf_counter() - start)
        m.exec_p50_ms, m.exec_p99_ms = pct(samples, 50) * 1e3, pct(samples, 99) * 1e3
        bare: list[float] = []
        for _ in range(EXEC_RUNS):
            start = time.perf_counter()
            await first.eval_cancelable("1 + 1")
            bare.append(time.perf_counter() - start)
        m.bare_p50_ms, m.bare_p99_ms = pct(bare, 50) * 1e3, pct(bare, 99) * 1e3

        # nested calls through the public API (wrap_py_function)
        async def echo(*args: Any) -> Any:
            return args[0] if args else None

        mr = self.context()
        async with mr.wrap_py_function(echo) as js_echo:
            mr.eval("globalThis")["echo"] = js_echo
            start = time.perf_counter()
            await self.run_cell(mr, seq_src("echo"))
            m.seq_us = (time.perf_counter() - start) / SEQ_CALLS * 1e6
            start = time.perf_counter()
            await self.run_cell(mr, par_src("echo"))
            m.par_us = (time.perf_counter() - start) / PAR_CALLS * 1e6
        start = time.perf_counter()
        await self.run_cell(mr, bare_seq_src())
        m.bare_seq_us = (time.perf_counter() - start) / BARE_CALLS * 1e6
        start = time.perf_counter()
        await self.run_cell(mr, bare_par_src())
        m.bare_par_us = (time.perf_counter() - start) / BARE_CALLS * 1e6

        # runaway loop: cancel the evaluation task, time until the isolate answers again
        spin = self.context()
        task = asyncio.ensure_future(spin.eval_cancelable("while (true) {}"))
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await spin.eval_cancelable("1")
        m.terminate_ms = (time.perf_counter() - start) * 1e3

        # the loop while a cell that called a tool spins for 0.5 s
        async def instant(*_args: Any) -> Any:
            return 1

        busy = self.context()
        async with busy.wrap_py_function(instant) as js_instant:
            busy.eval("globalThis")["t"] = js_instant
            spin_task = asyncio.ensure_future(
                busy.eval_cancelable("t(1); const e = Date.now() + 500; while (Date.now() < e) {}")
            )
            m.loop_lag_ms = await loop_lag_during(spin_task, 0.4)
            await spin_task
        m.notes.append(
            "wrap_py_function resolves the JS promise with a blocking call into the isolate:"
            " while a cell computes, the asyncio loop stalls (see lag row); with"
            " while(true){} the loop stays blocked until a thread other than the loop"
            " cancels the cell"
        )

        m.heap_outcome = await self._heap(HEAP_BOMB_SRC, first)
        m.arraybuffer_outcome = await self._heap(ARRAYBUFFER_SRC, first)
        return m

    async def _heap(self, src: str, other: Any) -> str:
        mr = self.context()
        mr.set_hard_memory_limit(HEAP_LIMIT_MB * 1024 * 1024)
        start = time.perf_counter()
        try:
            await self.run_cell(mr, src)
            outcome = "NOT stopped"
        except Exception as exc:
            outcome = f"{type(exc).__name__}"
        elapsed = (time.perf_counter() - start) * 1e3
        alive = await other.eval_cancelable("2 + 2") == 4
        return f"{outcome} {elapsed:.0f} ms; others {'ok' if alive else 'BROKEN'}"


# ---------------------------------------------------------------------------------
# candidate 2: the shipped engine (codemode.runtime.NodeEngine)


# One tool, ``echo``, at index 0 (the JSON ``LocalSession`` sends the engine with a cell).
ECHO_CONFIG = '{"tools":[["echo",0]],"all":[{"name":"echo","description":"Echo"}],"store":true}'
NO_TOOLS_CONFIG = '{"tools":[],"all":[],"store":true}'


class Cell:
    """The ``CellEvents`` of one benchmark cell: answers ``echo`` calls, notes start and end."""

    def __init__(self, engine: NodeEngine, echo: bool) -> None:
        loop = asyncio.get_running_loop()
        self.engine = engine
        self.echo = echo
        self.key = 0
        self.started = asyncio.Event()
        self.started_at = 0.0
        self.ended_at = 0.0
        self.done: asyncio.Future[str | None] = loop.create_future()  # error text or None
        self.exited: asyncio.Future[str] = loop.create_future()  # the reason
        self.tasks: set[asyncio.Task[None]] = set()

    def on_started(self) -> None:
        self.started_at = time.perf_counter()
        self.started.set()

    def on_item(self, item: object) -> None:
        pass

    def on_call(
        self, call_id: str, tool: int, input_json: str | None, strings: dict[str, str] | None = None
    ) -> None:
        # Like a delegate: the answer comes from a task of the asyncio loop.
        task = asyncio.ensure_future(self._answer(call_id, input_json))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, call_id: str, input_json: str | None) -> None:
        if not self.echo:
            self.engine.send_result(self.key, call_id, False, "no tools here")
            return
        self.engine.send_result(
            self.key, call_id, True, msgspec.Raw((input_json or "null").encode())
        )

    def on_notify(self, text: str) -> None:
        pass

    def on_yield(self, turn: int) -> None:
        pass

    def on_done(
        self,
        error: str | None,
        writes: list[tuple[str, str]],
        call: tuple[int, int, int] | None,
    ) -> None:
        self.ended_at = time.perf_counter()
        if not self.done.done():
            self.done.set_result(error)

    def on_exited(self, reason: str, detail: str | None) -> None:
        if not self.done.done():
            self.ended_at = time.perf_counter()
            self.done.set_result(f"exited: {reason}")
        if not self.exited.done():
            self.exited.set_result(reason)


class CodemodeBench:
    """The shipped engine: one confined Node.js process, a bare V8 isolate (isolated-vm) per cell."""

    @staticmethod
    def new_engine() -> NodeEngine:
        return NodeEngine()

    def start_cell(
        self, engine: NodeEngine, src: str, echo: bool = False, heap_mb: int | None = None
    ) -> Cell:
        cell = Cell(engine, echo)
        config = ECHO_CONFIG if echo else NO_TOOLS_CONFIG
        cell.key = engine.run_cell(cell, src, config, heap_mb)
        return cell

    async def execute(
        self, engine: NodeEngine, src: str, echo: bool = False, heap_mb: int | None = None
    ) -> Cell:
        cell = self.start_cell(engine, src, echo, heap_mb)
        await cell.exited
        return cell

    async def round_trip(self, engine: NodeEngine) -> float:
        """A ``terminate`` for a cell the host does not know, answered at once with ``exited``."""
        cell = Cell(engine, False)
        cell.key = -1 - len(engine._cells)
        engine._cells[cell.key] = cell
        start = time.perf_counter()
        engine._send({"t": "terminate", "cell": cell.key})
        await cell.exited
        return time.perf_counter() - start

    async def measure(self) -> Metrics:
        m = Metrics("codemode engine")
        engine = self.new_engine()
        start = time.perf_counter()
        await engine.start()
        m.notes.append(
            f"engine process start (confined; first start also loads the addon):"
            f" {(time.perf_counter() - start) * 1e3:.0f} ms"
        )
        try:
            await self._measure(engine, m)
        finally:
            await engine.aclose()
        return m

    async def _measure(self, engine: NodeEngine, m: Metrics) -> None:
        node = find_node()
        versions = subprocess.run(
            [node, "-p", "process.versions.node + ' / V8 ' + process.versions.v8"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        m.version = f"node {versions} / isolated-vm {ISOLATED_VM_VERSION}"

        progress("codemode: engine starts")
        # cold: what a session pays when no warm engine is waiting (process start + first cell)
        cold: list[float] = []
        for _ in range(5):
            fresh = self.new_engine()
            start = time.perf_counter()
            await fresh.start()
            cell = await self.execute(fresh, TRIVIAL_SRC)
            cold.append(time.perf_counter() - start)
            assert cell.done.result() is None, cell.done.result()
            await fresh.aclose()
        m.create_ms = statistics.median(cold) * 1e3
        m.notes.append(
            "cold start = engine process start + first cell (a fresh isolate is created for every"
            " cell, so the execute rows include it)"
        )

        progress("codemode: cells")
        samples: list[float] = []
        for _ in range(EXEC_RUNS):
            start = time.perf_counter()
            cell = self.start_cell(engine, TRIVIAL_SRC)
            error = await cell.done
            samples.append(time.perf_counter() - start)
            assert error is None, error
            await cell.exited
        m.exec_p50_ms, m.exec_p99_ms = pct(samples, 50) * 1e3, pct(samples, 99) * 1e3

        start = time.perf_counter()
        for _ in range(20):
            await self.execute(engine, TRIVIAL_SRC)
        m.notes.append(
            f"20 back-to-back trivial cells: {(time.perf_counter() - start) / 20 * 1e3:.1f} ms"
            " each (fresh isolate per cell)"
        )

        progress("codemode: frame round trip")
        bare: list[float] = []
        for _ in range(EXEC_RUNS):
            bare.append(await self.round_trip(engine))
        m.bare_p50_ms, m.bare_p99_ms = pct(bare, 50) * 1e3, pct(bare, 99) * 1e3

        async def timed(src: str, echo: bool, calls: int) -> float:
            """us per call, from 'started' (evaluation begins) to 'done'; median of 5."""
            samples: list[float] = []
            for _ in range(5):
                cell = self.start_cell(engine, src, echo)
                error = await cell.done
                assert error is None, error
                samples.append((cell.ended_at - cell.started_at) / calls * 1e6)
                await cell.exited
            return statistics.median(samples)

        progress("codemode: nested calls")
        m.seq_us = await timed(seq_src("tools.echo"), True, SEQ_CALLS)
        m.par_us = await timed(par_src("tools.echo"), True, PAR_CALLS)
        m.bare_seq_us = await timed(bare_seq_src(), False, BARE_CALLS)
        m.bare_par_us = await timed(bare_par_src(), False, BARE_CALLS)

        progress("codemode: runaway loop")
        # runaway loop; meanwhile the asyncio loop and another cell keep going
        spin = self.start_cell(engine, "while (true) {}")
        await spin.started.wait()
        m.loop_lag_ms = await loop_lag_during(spin.done, 0.2)
        other = await self.execute(engine, seq_src("tools.echo"), echo=True)
        assert other.done.result() is None, other.done.result()
        stops: list[float] = []
        for i in range(5):
            if i:
                spin = self.start_cell(engine, "while (true) {}")
                await spin.started.wait()
                await asyncio.sleep(0.02)
            start = time.perf_counter()
            engine.terminate(spin.key)
            reason = await spin.exited
            stops.append(time.perf_counter() - start)
            assert reason == "stopped", reason
        m.terminate_ms = statistics.median(stops) * 1e3

        progress("codemode: heap limit")
        m.heap_outcome = await self._heap(engine, HEAP_BOMB_SRC)
        m.arraybuffer_outcome = await self._heap(engine, ARRAYBUFFER_SRC)

        progress("codemode: engine restart")
        # recovery if the whole engine process dies (e.g. the kernel OOM killer)
        start = time.perf_counter()
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        fresh = self.new_engine()
        await fresh.start()
        await self.execute(fresh, TRIVIAL_SRC)
        m.notes.append(
            "engine killed -> new engine + first cell result:"
            f" {(time.perf_counter() - start) * 1e3:.0f} ms"
        )
        await fresh.aclose()

    async def _heap(self, engine: NodeEngine, src: str) -> str:
        start = time.perf_counter()
        cell = self.start_cell(engine, src, heap_mb=HEAP_LIMIT_MB)
        reason = await cell.exited
        elapsed = (time.perf_counter() - start) * 1e3
        error = cell.done.result()
        outcome = "NOT stopped" if error is None else reason
        if reason == "stopped" and error is not None:
            outcome = f"error {error.split(':')[0]!r}"  # the cell's own failure, e.g. a RangeError
        # "memory": the isolate's limit did not hold; the engine's RSS cap stopped the process
        restarted = not engine.running
        if restarted:
            await engine.start()
        after = await self.execute(engine, TRIVIAL_SRC)
        alive = after.done.result() is None
        state = "restarted" if restarted else "ok" if alive else "BROKEN"
        return f"{outcome} {elapsed:.0f} ms; engine {state}"


# ---------------------------------------------------------------------------------


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    start = time.perf_counter()
    print(f"[{name}] measuring ...", file=sys.stderr, flush=True)
    yield
    print(f"[{name}] done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


async def main(selected: list[str]) -> int:
    results: list[Metrics] = []
    if "mini-racer" in selected:
        mod = optional_module("py_mini_racer")
        if isinstance(mod, str):
            print(f"skip mini-racer: {mod} (pip install mini-racer)")
        else:
            with section("mini-racer"):
                results.append(await MiniRacerBench(mod).measure())
    if "codemode" in selected:
        with section("codemode engine"):
            results.append(await CodemodeBench().measure())
    if not results:
        print("no engine measured")
        return 1
    print_table(results)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("engines", nargs="*", help="subset of: mini-racer codemode (default: all)")
    args = parser.parse_args()
    chosen = cast(list[str], args.engines) or ["mini-racer", "codemode"]
    unknown = set(chosen) - {"mini-racer", "codemode"}
    if unknown:
        parser.error(f"unknown engine(s): {', '.join(sorted(unknown))}")
    sys.exit(asyncio.run(main(chosen)))
