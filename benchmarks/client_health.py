"""How long one client's large tool result holds the loop of a WebSocket host it shares.

Run: ``python -m benchmarks.client_health`` (``--loop asyncio|uvloop``).

A ``WebSocketHost`` serves a ``LocalSessionProvider`` on the loop of a ticker that sleeps 1 ms at
a time and records the longest gap between its wake-ups (the *hold*, as in
:mod:`benchmarks.health`). The client runs in a child process: its cell calls a tool once, and the
client answers with the value of the row, which reaches the host as one ``delegate/response``
frame (66 MB for 33 M backslashes). The cell then ends with a short text.

Figures are the median of ``ROUNDS`` runs of each row; nothing is asserted.
"""

from __future__ import annotations

import json
import statistics
from typing import Final

from benchmarks.common import progress, run_on_loop
from benchmarks.health import TICK, _held, _over_host
from codemode.runtime import LocalSessionProvider

ROUNDS: Final = 3

#: Row name, and the Python expression (in the child) of the tool's result.
ROWS: Final = [
    ("trivial cell (baseline)", "None"),
    ("tool result, 33 M backslashes (66 MB)", "'\\\\' * 33_000_000"),
    ("tool result, 11 M control characters (66 MB)", "'\\x01' * 11_000_000"),
    ("tool result, 64 M plain characters", "'x' * 64_000_000"),
]

#: The child: a client that answers the tool ``big`` with the value its input names, and runs
#: each cell it reads (one JSON string a line), writing a line when it ended.
_CLIENT = """
import asyncio, json, sys
from benchmarks.health import _in_session
from codemode.client.websocket import WebSocketCodeModeSessionProvider
from codemode.protocol import ToolDefinition, ToolName
from codemode.session import CodeModeSessionDelegate

ROWS = [eval(expression) for expression in json.loads(sys.argv[3])]

class Delegate(CodeModeSessionDelegate):
    async def invoke_tool(self, invocation, cancellation):
        return ROWS[invocation.input["row"]]

async def main():
    async with WebSocketCodeModeSessionProvider(sys.argv[1]) as provider:
        session = await provider.create_session(Delegate())
        run = _in_session(session)
        for line in sys.stdin:
            await run(json.loads(line))
            print("done", flush=True)

asyncio.run(main())
"""


def _source(row: int) -> str:
    return f'await tools.size({{row: {row}}}); text("ok")'


async def run() -> None:
    rows: list[tuple[str, float]] = []
    expressions = json.dumps([expression for _, expression in ROWS])
    async with (
        LocalSessionProvider() as provider,
        _over_host(provider, "websocket", _CLIENT, expressions) as client,
    ):
        await _held(client, 'text("warm")')
        for index, (name, _) in enumerate(ROWS):
            progress(name)
            holds = [await _held(client, _source(index)) for _ in range(ROUNDS)]
            rows.append((name, statistics.median(holds)))
    width = max(len(name) for name, _ in rows)
    print(f"| {'client message'.ljust(width)} | longest hold, ms |")
    print(f"| {'-' * width} | ---------------- |")
    for name, hold in rows:
        print(f"| {name.ljust(width)} | {hold * 1000:16.1f} |")
    print(
        f"\nMedian of {ROUNDS} runs per row, WebSocket host; the hold is the longest gap between"
        f" the wake-ups of a {TICK * 1000:g} ms ticker on the host's loop, less the tick."
    )


def main() -> None:
    """Run the benchmark (``--loop asyncio|uvloop``) and print one table."""
    run_on_loop(run, __doc__)


if __name__ == "__main__":
    main()
