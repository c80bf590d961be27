"""How long one hostile cell holds the event loop every session of a provider shares.

Run: ``python -m benchmarks.health`` (``--loop asyncio|uvloop``).

A ticker task sleeps 1 ms at a time on the loop of an embedded ``LocalSessionProvider`` and records
the longest gap between its wake-ups (the *hold*: how long a bystander session's next step waits)
while one cell runs in another session. Each cell does one large thing — an item, a thrown text,
a notification, a stored value, a tool input, many calls, many notifications, many keys — at the
size its limits allow. The baselines, measured in the same run: the hold of a trivial cell, and a
single ``msgspec.json.decode`` of a JSON string as large as the cell's data (the least Python can
do with it once: the ratio says how many such passes the loop makes in one stretch).

``CODEMODE_HEALTH_CARRIER=websocket`` (or ``grpc``) measures a host instead: the provider is
served by a ``WebSocketHost`` (``GrpcHost``) on the ticker's loop, and the cells run in a session
of a client in a child process (so that the client's own work stays off the measured loop). The
host then also encodes each callback and answer for the client.

Figures are the median of ``ROUNDS`` runs of each cell; nothing is asserted.
``CODEMODE_HEALTH_ONLY=text|store`` runs only the rows whose name holds ``text`` or ``store`` (and
the baseline).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import msgspec

from benchmarks.common import progress, run_on_loop
from codemode.host.address import WebSocketAddress
from codemode.host.grpc import GrpcHost
from codemode.host.websocket import WebSocketHost
from codemode.protocol import (
    JSON,
    CodeModeNestedToolCall,
    ExecuteRequest,
    Result,
    ToolDefinition,
    ToolName,
    WaitRequest,
    Yielded,
)
from codemode.runtime import LocalSessionProvider
from codemode.session import CancellationToken, CodeModeSession, CodeModeSessionDelegate

ROUNDS: Final = 3
MI: Final = 1024 * 1024
TICK: Final = 0.001


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    #: Characters of data the cell hands to Python (0: no decode baseline).
    chars: int


CASES: Final = [
    Case("trivial cell (baseline)", 'text("ok")', 0),
    Case("text item, 16 Mi characters", 'text("x".repeat(16 * 1024 * 1024 - 64))', 16 * MI),
    Case("thrown text, 16 Mi characters", 'throw "x".repeat(16 * 1024 * 1024)', 16 * MI),
    Case(
        "image, 16 Mi-character data URL",
        'image("data:image/png;base64," + "A".repeat(16e6))',
        16 * MI,
    ),
    Case("notification, 60 M characters", 'notify("x".repeat(60e6)); text("ok")', 60_000_000),
    Case("store, one 60 M-character value", 'store("k", "x".repeat(60e6)); text("ok")', 60_000_000),
    Case(
        "store, 200,000 small keys",
        'for (let i = 0; i < 200000; i++) store("k" + i, i); text("ok")',
        200_000 * 12,
    ),
    Case(
        "tool input, 50 M characters",
        'await tools.size({s: "x".repeat(50e6)}); text("ok")',
        50_000_000,
    ),
    Case(
        "1,000 tool calls at once",
        "await Promise.all(Array.from({length: 1000}, (_, i) => tools.size({i}))); text('ok')",
        0,
    ),
    Case("10,000 notifications", 'for (let i = 0; i < 10000; i++) notify("n" + i); text("ok")', 0),
    # Text that JSON escapes: each character takes two bytes (a backslash) or six (a control
    # character) in the engine's frame, and a tool input's text is escaped twice.
    Case(
        "tool input, 63 M backslashes",
        'await tools.size("\\\\".repeat(63e6)); text("ok")',
        63_000_000,
    ),
    Case("text item, 42 M control characters", 'text("\\x01".repeat(42e6))', 42_000_000),
    Case(
        "notification, 40 M control characters",
        'notify("\\x01".repeat(40e6)); text("ok")',
        40_000_000,
    ),
    Case(
        "store, one value of 33 M backslashes",
        'store("k", "\\\\".repeat(33e6)); text("ok")',
        33_000_000,
    ),
]

SIZE = ToolDefinition(
    name="size",
    tool_name=ToolName("size"),
    description="Returns how many characters its input's JSON has.",
    input_schema={"type": "object"},
)


class _Delegate(CodeModeSessionDelegate):
    """Serves ``size`` with a small answer: the tool's own work stays out of the hold."""

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        return {"ok": isinstance(invocation.input, dict)}


class _Runner(Protocol):
    async def __call__(self, source: str) -> None: ...


def _in_session(session: CodeModeSession) -> _Runner:
    """Runs a cell in ``session`` to its end."""

    async def run(source: str) -> None:
        started = await session.execute(
            ExecuteRequest(
                tool_call_id="health", source=source, enabled_tools=[SIZE], yield_time_ms=60_000
            )
        )
        response = await started.initial_response()
        while isinstance(response, Yielded):
            outcome = await session.wait(WaitRequest(started.cell_id, 60_000))
            response = outcome.response
        assert isinstance(response, Result), response

    return run


#: The child of the ``websocket`` and ``grpc`` carriers: a client that runs each cell it reads
#: (one JSON string a line) in one session and writes a line when it ended.
_CLIENT = """
import asyncio, json, sys
from benchmarks.health import SIZE, _Delegate, _in_session
from codemode.client.grpc import GrpcCodeModeSessionProvider
from codemode.client.websocket import WebSocketCodeModeSessionProvider
from codemode.errors import CodeModeError

async def main():
    remote = GrpcCodeModeSessionProvider if sys.argv[2] == "grpc" else WebSocketCodeModeSessionProvider
    async with remote(sys.argv[1]) as provider:
        run = _in_session(await provider.create_session(_Delegate()))
        for line in sys.stdin:
            try:
                await run(json.loads(line))
            except CodeModeError:  # an answer too large for a frame: refused, as it should be
                pass
            print("done", flush=True)

asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def _over_host(
    provider: LocalSessionProvider, carrier: str, client: str = _CLIENT, *arguments: str
) -> AsyncIterator[_Runner]:
    """A host of ``provider`` on this loop, and a runner of cells in a session of ``client``
    (a script run as ``python -c CLIENT URL CARRIER *ARGUMENTS`` in a child process)."""
    host: WebSocketHost | GrpcHost
    if carrier == "grpc":
        host = GrpcHost(provider, "grpc://127.0.0.1:0")
    else:
        host = WebSocketHost(provider, WebSocketAddress("127.0.0.1", 0, "/"))
    await host.start()
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        client,
        host.url,
        carrier,
        *arguments,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout

    async def run(source: str) -> None:
        stdin.write(json.dumps(source).encode() + b"\n")
        await stdin.drain()
        assert await stdout.readline() == b"done\n", "the client failed (see its stderr)"

    try:
        yield run
    finally:
        stdin.close()
        await child.wait()
        await host.aclose()


async def _held(run: _Runner, source: str) -> float:
    """The longest gap of the ticker (seconds) while ``source`` runs to its end."""
    longest = 0.0
    running = True

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while running:
            await asyncio.sleep(TICK)
            now = time.perf_counter()
            longest = max(longest, now - last - TICK)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    longest = 0.0
    try:
        await run(source)
    finally:
        running = False
        await task
    return longest


def _decode_floor(chars: int) -> float:
    """Seconds of one ``msgspec.json.decode`` of a JSON string of ``chars`` characters."""
    data = b'"' + b"x" * chars + b'"'
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        msgspec.json.decode(data)
        best = min(best, time.perf_counter() - began)
    return best


async def run() -> None:
    rows: list[tuple[str, float, float | None]] = []
    carrier = os.environ.get("CODEMODE_HEALTH_CARRIER", "embedded")
    async with contextlib.AsyncExitStack() as stack:
        provider = await stack.enter_async_context(LocalSessionProvider())
        if carrier in ("websocket", "grpc"):
            run = await stack.enter_async_context(_over_host(provider, carrier))
        else:
            session = await provider.create_session(_Delegate())
            stack.push_async_callback(session.shutdown)
            run = _in_session(session)
        await _held(run, 'text("warm")')
        only = os.environ.get("CODEMODE_HEALTH_ONLY", "")  # substrings of the rows to run, "|"
        for case in CASES:
            if only and case is not CASES[0] and not any(w in case.name for w in only.split("|")):
                continue
            progress(case.name)
            holds = [await _held(run, case.source) for _ in range(ROUNDS)]
            floor = _decode_floor(case.chars) if case.chars else None
            rows.append((case.name, statistics.median(holds), floor))
    baseline = rows[0][1]
    head = ("cell", "longest hold, ms", "÷ trivial cell", "one decode of its data, ms", "÷ decode")
    body = [
        (
            name,
            f"{hold * 1000:.1f}",
            f"{hold / baseline:.0f}x" if baseline > 0 else "-",
            "-" if floor is None else f"{floor * 1000:.1f}",
            "-" if floor is None else f"{hold / floor:.1f}x",
        )
        for name, hold, floor in rows
    ]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    for row in [head, tuple("-" * width for width in widths), *body]:
        print(
            "| "
            + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            + " |"
        )
    print(
        f"\nMedian of {ROUNDS} runs per cell, {carrier} session; the hold is the longest"
        f" gap between the wake-ups of a {TICK * 1000:g} ms ticker on the same loop, less the tick."
    )


def main() -> None:
    """Run the benchmark (``--loop asyncio|uvloop``) and print one table."""
    run_on_loop(run, __doc__)


if __name__ == "__main__":
    main()
