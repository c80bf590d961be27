"""Our host beside the upstream host: the same raw V1 client (stdlib only) drives both over stdio.

Figures (each host measured in the same run, alternating blocks):

* trivial execute (``text(1)``) → its initial response, p50 / p99, back to back and 10 ms apart;
  back to back also split (diagnostic) into the first cells of each block, which follow seconds of
  idleness, and the rest;
* cells per second back to back on one session, and with 4 and 16 sessions of one connection each
  keeping one cell in flight;
* nested call round trip (a cell awaiting a tool 300 times), µs per call;
* start-up: host process started → hello, session, first trivial cell's result, ms (a fresh
  process each time; with ``PYTHONDONTWRITEBYTECODE`` set, ours recompiles its modules on every
  start);
* memory, after the timed figures (a fresh process per host): resident memory of the host and
  every process under it (``/proc/PID/statm``), per idle session (16 sessions that each ran a cell,
  against one) and per running cell (16 cells blocked on a promise in one session).

The client writes frames with ``struct`` + ``json`` and answers ``delegate/request`` itself, so the
figures include no codemode client code. The upstream host (``codex-code-mode-host`` of
``@openai/codex@0.149.0-linux-x64``) is used when ``tests/upstream.py`` can provide it (fetched once
with npm); otherwise its column says why not.

Run: ``python -m benchmarks.hosts``.
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

from benchmarks.common import loop_option, percentile, progress

#: Executes per pacing and host: p99 is then the tenth slowest, not the second (with 200 it moved
#: by a millisecond between runs on one rare stall).
SAMPLES: Final = 1000
PACED_S: Final = 0.010
RATE_CELLS: Final = 200
#: Sessions of one connection with a cell in flight each, for the cells-per-second rows.
LANES: Final = (4, 16)
MEMORY_SESSIONS: Final = 16
BLOCKED_CELLS: Final = 16
BLOCKED: Final = "await new Promise(() => {});"
NESTED_CALLS: Final = 300
BLOCKS: Final = 4
STARTS: Final = 5
#: Back to back, the first cells of a block follow seconds of idleness (the other host's turn):
#: the diagnostic row splits them from the rest.
AFTER_PAUSE: Final = 40


class RawClient:
    """A blocking V1 client over a child's stdio; one session."""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        self.next_id = 1
        self.send(
            {
                "type": "connection/hello",
                "supportedVersions": [1],
                "requiredCapabilities": [],
                "optionalCapabilities": [],
            }
        )
        assert self.receive()["type"] == "connection/ready"
        self.sessions = 0
        self.open_session()

    def open_session(self) -> str:
        """Open one more session (``s1``, ``s2``, ...); its answer is read with later traffic."""
        self.sessions += 1
        session = f"s{self.sessions}"
        self.request({"method": "session/open", "sessionId": session})
        return session

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        body = json.dumps(message, separators=(",", ":")).encode()
        self.process.stdin.write(struct.pack("<I", len(body)) + body)
        self.process.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        head = self.process.stdout.read(4)
        if len(head) < 4:
            raise RuntimeError("the host closed its stdout")
        (size,) = struct.unpack("<I", head)
        message: dict[str, Any] = json.loads(self.process.stdout.read(size))
        return message

    def request(self, request: dict[str, Any]) -> int:
        request_id = self.next_id
        self.next_id += 1
        self.send({"type": "operation/request", "id": request_id, "request": request})
        return request_id

    def start(
        self,
        source: str,
        tools: list[dict[str, Any]] | None = None,
        session: str = "s1",
        yield_ms: int = 30_000,
    ) -> int:
        """Send an execute; return its request id."""
        return self.request(
            {
                "method": "session/execute",
                "sessionId": session,
                "request": {
                    "tool_call_id": "c",
                    "enabled_tools": tools or [],
                    "source": source,
                    "yield_time_ms": yield_ms,
                    "max_output_tokens": None,
                },
            }
        )

    def next_answer(self, kinds: tuple[str, ...]) -> dict[str, Any]:
        """The next message of one of ``kinds``, answering tool calls with their input meanwhile."""
        while True:
            message = self.receive()
            kind = message["type"]
            if kind in kinds:
                return message
            if kind == "delegate/request":
                invocation = message["request"]
                self.send(
                    {
                        "type": "delegate/response",
                        "id": message["id"],
                        "result": {
                            "status": "ok",
                            "value": {
                                "type": "tool/result",
                                "result": invocation.get("invocation", {}).get("input"),
                            },
                        },
                    }
                )

    def execute(
        self, source: str, tools: list[dict[str, Any]] | None = None, session: str = "s1"
    ) -> dict[str, Any]:
        """Run a cell to its initial response, answering tool calls with their input."""
        request_id = self.start(source, tools, session)
        while True:
            message = self.next_answer(("execute/initialResponse",))
            if message["id"] == request_id:
                result: dict[str, Any] = message["result"]
                return result

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


ECHO: Final = {
    "name": "echo",
    "tool_name": {"name": "echo", "namespace": None},
    "description": "echo",
    "kind": "function",
    "input_schema": None,
    "output_schema": None,
}


def print_table(head: tuple[str, ...], body: list[tuple[str, ...]], footer: str) -> None:
    """One Markdown table, then a footer line."""
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    for index, line in enumerate((head, *body)):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
        if index == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print()
    print(footer)


def latencies(client: RawClient, pause: float) -> list[float]:
    out = []
    for _ in range(SAMPLES // BLOCKS):
        began = time.perf_counter()
        client.execute("text(1)")
        out.append((time.perf_counter() - began) * 1e3)
        if pause:
            time.sleep(pause)
    return out


def cells_per_second(client: RawClient) -> float:
    began = time.perf_counter()
    for _ in range(RATE_CELLS // BLOCKS):
        client.execute("text(1)")
    return (RATE_CELLS // BLOCKS) / (time.perf_counter() - began)


def cells_in_flight(client: RawClient, lanes: int) -> float:
    """Cells per second with the first ``lanes`` sessions each keeping one trivial cell in
    flight on the one connection (a session's next execute leaves when its cell answered)."""
    while client.sessions < lanes:
        client.open_session()
    cells = 2 * RATE_CELLS // BLOCKS
    began = time.perf_counter()
    lane_of = {client.start("text(1)", session=f"s{lane + 1}"): lane for lane in range(lanes)}
    sent, done = lanes, 0
    while done < cells:
        message = client.next_answer(("execute/initialResponse",))
        lane = lane_of.pop(message["id"])
        assert message["result"].get("status") == "ok", message
        done += 1
        if sent < cells:
            lane_of[client.start("text(1)", session=f"s{lane + 1}")] = lane
            sent += 1
    return cells / (time.perf_counter() - began)


def tree_rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and every process under it, KiB (``/proc``)."""
    total, pending = 0, [pid]
    page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
    while pending:
        current = pending.pop()
        try:
            total += int(Path(f"/proc/{current}/statm").read_text().split()[1]) * page_kib
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue  # gone meanwhile
    return total


def memory(command: list[str]) -> tuple[float, float]:
    """MiB per idle session and per running cell, in a fresh host process (see the docstring)."""
    client = RawClient(command)
    try:
        client.execute("text(1)")
        time.sleep(0.5)
        one = tree_rss_kib(client.process.pid)
        for _ in range(MEMORY_SESSIONS - 1):
            client.execute("text(1)", session=client.open_session())
        time.sleep(0.5)
        idle = tree_rss_kib(client.process.pid)
        blocked = [client.start(BLOCKED, yield_ms=50) for _ in range(BLOCKED_CELLS)]
        cells = []
        for _ in blocked:
            answer = client.next_answer(("execute/initialResponse",))
            cells.append(answer["result"]["value"]["Yielded"]["cell_id"])
        time.sleep(0.5)
        running = tree_rss_kib(client.process.pid)
        stops = {
            client.request({"method": "session/terminate", "sessionId": "s1", "cellId": cell_id})
            for cell_id in cells
        }
        while stops:
            stops.discard(client.next_answer(("operation/response",))["id"])
    finally:
        client.close()
    per_session = (idle - one) / (MEMORY_SESSIONS - 1) / 1024
    return per_session, (running - idle) / BLOCKED_CELLS / 1024


def nested_us(client: RawClient) -> float:
    source = (
        f"const t = Date.now(); for (let i = 0; i < {NESTED_CALLS}; i++) await tools.echo({{i}});"
        " text(String(Date.now() - t));"
    )
    result = client.execute(source, [ECHO])
    ms = float(result["value"]["Result"]["content_items"][0]["text"])
    return ms * 1e3 / NESTED_CALLS


def start_ms(command: list[str]) -> float:
    """Spawn the host, open a session, run one trivial cell: how long until its result."""
    began = time.perf_counter()
    client = RawClient(command)
    try:
        client.execute("text(1)")
        return (time.perf_counter() - began) * 1e3
    finally:
        client.close()


def hosts() -> dict[str, list[str] | str]:
    """Host name → command, or the reason it is not available."""
    found: dict[str, list[str] | str] = {
        "codemode host": [sys.executable, "-m", "codemode", "host", "--stdio"]
    }
    try:
        from tests.upstream import unavailable_reason, upstream_host
    except ImportError:
        found["upstream 0.149.0"] = "tests/upstream.py not importable (run from the checkout)"
        return found
    binary = upstream_host()
    found["upstream 0.149.0"] = (
        [str(binary), "--listen", "stdio"] if binary is not None else unavailable_reason()
    )
    return found


def main() -> None:
    loop = loop_option(__doc__)  # our host's event loop (this client has none)
    began = time.perf_counter()
    commands = hosts()
    ours = commands["codemode host"]
    assert isinstance(ours, list)
    ours += ["--loop", loop]
    clients = {
        name: RawClient(command) for name, command in commands.items() if isinstance(command, list)
    }
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in clients}
    try:
        for client in clients.values():
            for _ in range(20):
                client.execute("text(1)")  # warm up
        for block in range(BLOCKS):
            progress(f"block {block + 1} of {BLOCKS}")
            for name, client in clients.items():
                into = figures[name]
                block_b2b = latencies(client, 0)
                into.setdefault("b2b", []).extend(block_b2b)
                into.setdefault("b2b_after", []).extend(block_b2b[:AFTER_PAUSE])
                into.setdefault("b2b_warm", []).extend(block_b2b[AFTER_PAUSE:])
                into.setdefault("paced", []).extend(latencies(client, PACED_S))
                into.setdefault("rate", []).append(cells_per_second(client))
                for lanes in LANES:
                    into.setdefault(f"rate{lanes}", []).append(cells_in_flight(client, lanes))
                into.setdefault("nested", []).append(nested_us(client))
                command = commands[name]
                assert isinstance(command, list)
                into.setdefault("start", []).extend(start_ms(command) for _ in range(STARTS))
    finally:
        for client in clients.values():
            client.close()
    progress("memory: a fresh process per host")
    for name, command in commands.items():
        if isinstance(command, list):
            per_session, per_cell = memory(command)
            figures[name]["session_mib"] = [per_session]
            figures[name]["cell_mib"] = [per_cell]
    progress(f"done in {time.perf_counter() - began:.0f} s")

    def cell(name: str, key: str) -> str:
        values = figures.get(name, {}).get(key)
        if values is None:
            reason = commands[name]
            return f"n/a ({reason})" if isinstance(reason, str) else "n/a"
        if key in ("b2b", "paced", "start", "b2b_after", "b2b_warm"):
            return f"{statistics.median(values):.2f} / {percentile(values, 99):.2f}"
        if key.endswith("_mib"):
            return f"{statistics.median(values):.2f}"
        return f"{statistics.median(values):.0f}"

    ours, theirs = list(commands)
    rows: list[tuple[str, ...]] = []
    for key, label in (
        ("b2b", "trivial execute, back to back, p50 / p99, ms"),
        ("b2b_after", f"- diagnostic: first {AFTER_PAUSE} of each block, p50 / p99, ms"),
        ("b2b_warm", "- diagnostic: the rest of each block, p50 / p99, ms"),
        ("paced", "trivial execute, 10 ms apart, p50 / p99, ms"),
        ("rate", "cells per second, one session back to back"),
        *((f"rate{n}", f"cells per second, {n} sessions in flight") for n in LANES),
        ("nested", "nested call, sequential, us/call"),
        ("start", "host start -> first cell result, p50 / p99, ms"),
        ("session_mib", f"RSS per idle session, MiB ({MEMORY_SESSIONS} sessions against 1)"),
        ("cell_mib", f"RSS per running cell, MiB ({BLOCKED_CELLS} blocked in one session)"),
    ):
        ratio = ""
        if key in figures.get(ours, {}) and key in figures.get(theirs, {}):
            mine = statistics.median(figures[ours][key])
            reference = statistics.median(figures[theirs][key])
            ratio = f"{mine / reference:.2f}x"
            if key in ("b2b", "paced", "b2b_after", "b2b_warm"):  # issue #15's goal: p99s too
                tail = percentile(figures[ours][key], 99) / percentile(figures[theirs][key], 99)
                ratio += f" / {tail:.2f}x"
        rows.append((label, cell(ours, key), cell(theirs, key), ratio))
    print_table(
        ("metric", "codemode host (ours)", "upstream host (baseline)", "ours / upstream"),
        rows,
        f"Same raw stdlib V1 client over stdio for both hosts; {SAMPLES} executes per pacing, "
        f"{BLOCKS} alternating blocks; {os.cpu_count()} CPUs.",
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
