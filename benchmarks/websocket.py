"""Protocol V1 over WebSocket (single and dual) beside a raw ``websockets`` echo, same run.

Run: ``python -m benchmarks.websocket`` from the repository root (about a minute on 2 cores).
Prints one Markdown table. A ``codemode host --listen ws://127.0.0.1:0`` child serves two
clients of this process, one on a single socket and one on a control + bulk pair; a child
running a bare ``websockets`` echo server (binary messages back as they come) is the baseline.
The embedded session (no carrier) is measured beside them, as the floor of the engine path.

Figures: nested tool call round trip (a cell awaiting ``tools.echo`` one call at a time; each
interval between two successive ``invoke_tool`` calls is one round trip) against the raw echo's
round trip of the same ``delegate/request`` frame; and the throughput of a tool result of 1, 16
and 64 MiB (a cell awaits ``tools.big``, which returns a string of that size; timed in the cell)
against the raw echo of a message of that size (both directions, so its one-way rate is twice
its size over the round trip). Goals (the WebSocket issue): the carrier adds at most 1.5x the raw
echo's round trip on top of the embedded session; large results travel at >= 0.7x the raw echo.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Final

from websockets.asyncio.client import connect

from benchmarks.common import (
    loop_arguments,
    loop_source,
    only_text,
    percentile,
    progress,
    run_on_loop,
)
from benchmarks.transport import ECHO_TOOL, EchoDelegate, Served, bounded, echo_frame
from codemode.client import RemoteSession
from codemode.client.websocket import WebSocketCodeModeSessionProvider
from codemode.protocol import (
    JSON,
    CodeModeNestedToolCall,
    CodeModeToolKind,
    ExecuteRequest,
    ToolDefinition,
    ToolName,
)
from codemode.protocol.constants import MAX_WEBSOCKET_MESSAGE_BYTES
from codemode.protocol.v1 import encode_frame
from codemode.runtime import LocalSessionProvider
from codemode.session import CancellationToken

SEQ_CALLS: Final = 300
CELLS: Final = 7
SETTLE_MS: Final = 30
ECHO_ROUND_TRIPS: Final = 2000
SIZES_MIB: Final = (1, 16, 64)
BIG_SAMPLES: Final = 5
GOAL_ADDED_VS_ECHO: Final = 1.5
GOAL_THROUGHPUT: Final = 0.7
MIB: Final = 1024 * 1024

BIG_TOOL: Final = ToolDefinition("big", ToolName.plain("big"), "Big", CodeModeToolKind.FUNCTION)

#: The baseline: a bare ``websockets`` server that sends every binary message back.
ECHO_SERVER: Final = f"""\
import asyncio
from websockets.asyncio.server import serve

async def echo(connection):
    async for message in connection:
        await connection.send(message)

async def main():
    async with serve(echo, "127.0.0.1", 0, compression=None,
                     max_size={MAX_WEBSOCKET_MESSAGE_BYTES}, ping_interval=None) as server:
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Future()

asyncio.run(main())
"""


class BigDelegate(EchoDelegate):
    """``echo`` as in the stdio benchmark, and ``big``: a string of ``input.mib`` MiB."""

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        if invocation.tool_name.name == "big":
            assert isinstance(invocation.input, dict)
            return "x" * length(int(invocation.input["mib"]))
        return await super().invoke_tool(invocation, cancellation)


def length(mib: int) -> int:
    """Characters of the ``mib`` MiB result: its whole ``delegate/response`` frame must fit in
    the 64 MiB frame limit."""
    return mib * MIB - 256


def big_source(mib: int) -> str:
    return (
        f"const started = Date.now(); const value = await tools.big({{mib: {mib}}});"
        " text(String(Date.now() - started) + ' ' + value.length);"
    )


async def big_result_seconds(served: Served, mib: int) -> float:
    started = await bounded(
        served.session.execute(ExecuteRequest("big", big_source(mib), [ECHO_TOOL, BIG_TOOL]))
    )
    milliseconds, size = only_text(await bounded(started.initial_response())).split()
    assert int(size) == length(mib)
    return max(float(milliseconds), 0.5) / 1e3


async def echo_round_trips(url: str, frame: bytes, count: int) -> list[float]:
    samples: list[float] = []
    async with connect(url, compression=None, max_size=MAX_WEBSOCKET_MESSAGE_BYTES) as socket:
        for _ in range(count):
            start = time.perf_counter()
            await socket.send(frame)
            await socket.recv()
            samples.append(time.perf_counter() - start)
    return samples


async def open_session(
    name: str, provider: WebSocketCodeModeSessionProvider | LocalSessionProvider
) -> Served:
    delegate = BigDelegate()
    session = await bounded(provider.create_session(delegate))
    served = Served(name, session, delegate, [])
    await served.run(loop_source("seq", "tools.echo", 2, 1, SETTLE_MS))
    return served


def spawn_line(*command: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``command``; its first stdout line (a URL or a port)."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


async def run() -> None:
    began = time.perf_counter()
    host, url = spawn_line(
        sys.executable, "-m", "codemode", "host", "--listen", "ws://127.0.0.1:0", *loop_arguments()
    )
    echo, port = spawn_line(sys.executable, "-c", ECHO_SERVER)
    echo_url = f"ws://127.0.0.1:{port}"
    providers: dict[str, WebSocketCodeModeSessionProvider | LocalSessionProvider] = {
        "ws single": WebSocketCodeModeSessionProvider(url),
        "ws dual": WebSocketCodeModeSessionProvider(url, dual=True),
        "embedded": LocalSessionProvider(),
    }
    try:
        progress("opening sessions")
        served = [await open_session(name, p) for name, p in providers.items()]
        remote = served[0]
        invocation = remote.delegate.last
        assert invocation is not None and isinstance(remote.session, RemoteSession)
        frame = bytes(encode_frame(echo_frame(remote.session.session_id, invocation)))
        seq: dict[str, list[float]] = {s.name: [] for s in served}
        seq["raw echo"] = []
        progress(f"nested calls: {CELLS} cells x {SEQ_CALLS} sequential per session kind")
        for one in served:
            await one.round_trips()
        await echo_round_trips(echo_url, frame, 200)
        for _ in range(CELLS):
            for one in served:
                seq[one.name] += await one.round_trips()
            seq["raw echo"] += await echo_round_trips(echo_url, frame, ECHO_ROUND_TRIPS // CELLS)
        progress(f"large results: {SIZES_MIB} MiB x {BIG_SAMPLES}")
        big: dict[tuple[str, int], list[float]] = {}
        for mib in SIZES_MIB:
            payload = b"x" * (mib * MIB)
            for _ in range(BIG_SAMPLES):
                for one in served:
                    big.setdefault((one.name, mib), []).append(await big_result_seconds(one, mib))
                trip = await echo_round_trips(echo_url, payload, 1)
                big.setdefault(("raw echo", mib), []).append(trip[0] / 2)  # one way
    finally:
        for provider in providers.values():
            await provider.aclose()
        for child in (host, echo):
            child.terminate()
            child.wait(30)
    echo_p50 = percentile(seq["raw echo"], 50)
    embedded_p50 = percentile(seq["embedded"], 50)
    print("| figure | ws single | ws dual | embedded | raw websockets echo |")
    print("|---|---|---|---|---|")
    cells = [_us(percentile(seq[name], 50)) for name in ("ws single", "ws dual", "embedded")]
    print(f"| nested call round trip p50, us | {' | '.join(cells)} | {_us(echo_p50)} |")
    added = {name: percentile(seq[name], 50) - embedded_p50 for name in ("ws single", "ws dual")}
    print(
        "| added over embedded, us (x raw echo) | "
        + " | ".join(f"{_us(v)} ({v / echo_p50:.1f}x)" for v in added.values())
        + " | - | - |"
    )
    ratios: dict[str, list[float]] = {"ws single": [], "ws dual": []}
    for mib in SIZES_MIB:
        rate = {
            name: mib / statistics.median(big[(name, mib)])
            for name in ("ws single", "ws dual", "embedded", "raw echo")
        }
        for name, values in ratios.items():
            values.append(rate[name] / rate["raw echo"])
        print(
            f"| {mib} MiB tool result, MiB/s (x raw echo) | "
            + " | ".join(
                f"{rate[n]:.0f} ({rate[n] / rate['raw echo']:.2f}x)"
                for n in ("ws single", "ws dual", "embedded")
            )
            + f" | {rate['raw echo']:.0f} one way |"
        )
    print()
    budget = GOAL_ADDED_VS_ECHO * echo_p50
    print(f"Goals (WebSocket issue), Python {platform.python_version()}, {os.cpu_count()} CPUs:")
    for name, value in added.items():
        verdict = "met" if value <= budget else "NOT met"
        print(
            f"- {name}: adds {_us(value)} us over embedded vs budget {_us(budget)} us"
            f" ({GOAL_ADDED_VS_ECHO:g} x raw echo {_us(echo_p50)} us) -- {verdict}"
        )
    for name, values in ratios.items():
        worst = min(values)
        verdict = "met" if worst >= GOAL_THROUGHPUT else "NOT met"
        print(
            f"- {name}: large results at >= {GOAL_THROUGHPUT:g}x the raw echo: worst"
            f" {worst:.2f}x -- {verdict}"
        )
    print(
        f"Round trips: {CELLS} cells x {SEQ_CALLS} calls per session kind, echo"
        f" {ECHO_ROUND_TRIPS} round trips, interleaved. Large results: median of {BIG_SAMPLES},"
        " timed in the cell (Date.now(), ms); the echo's one-way time is half its round trip."
    )
    progress(f"done in {time.perf_counter() - began:.0f} s")


def main() -> None:
    """Run the benchmark (``--loop asyncio|uvloop``, the host included) and print one table."""
    run_on_loop(run, __doc__)


if __name__ == "__main__":
    main()
