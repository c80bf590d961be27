"""Measuring aids shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from codemode.protocol import InputText, Result, RuntimeResponse

__all__ = [
    "cpu_ticks",
    "loop_arguments",
    "loop_option",
    "loop_source",
    "only_text",
    "percentile",
    "progress",
    "quiesce",
    "run_on_loop",
]


def loop_option(description: str | None) -> str:
    """Parse the command line, ``--loop asyncio|uvloop`` (default asyncio): the loop this
    benchmark and the hosts it starts run on (``description``: the script's docstring)."""
    parser = argparse.ArgumentParser(description=(description or "").partition("\n")[0] or None)
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the event loop of this process and of the codemode hosts it starts",
    )
    return str(parser.parse_args().loop)


def run_on_loop(main: Callable[[], Coroutine[Any, Any, None]], description: str | None) -> None:
    """Run ``main()`` on the loop ``--loop`` names, as the codemode commands do."""
    from codemode.cli.common import run_main

    run_main(main, loop_option(description))


def loop_arguments() -> list[str]:
    """``--loop KIND`` for a codemode host started from inside the running loop: the same
    kind as this process's."""
    module = type(asyncio.get_running_loop()).__module__
    return ["--loop", "uvloop" if module.startswith("uvloop") else "asyncio"]


def loop_source(kind: str, function: str, calls: int, rounds: int, settle_ms: int) -> str:
    """JS for ``rounds`` x ``calls`` awaits of ``function`` (``seq`` one by one, else ``Promise.all``).

    The cell first waits ``settle_ms``, then prints the elapsed milliseconds of the loops alone.
    """
    if kind == "seq":
        body = f"for (let i = 0; i < {calls}; i++) {{ const v = await {function}({{ i }}); s += v.i; }}"
    else:
        body = (
            f"const ps = []; for (let i = 0; i < {calls}; i++) ps.push({function}({{ i }}));"
            " for (const v of await Promise.all(ps)) s += v.i;"
        )
    return (
        "const local = async (x) => x;\n"
        f"await new Promise((resolve) => setTimeout(resolve, {settle_ms}));\n"
        "let s = 0;\n"
        "const t0 = Date.now();\n"
        f"for (let r = 0; r < {rounds}; r++) {{ {body} }}\n"
        "text(Date.now() - t0);\n"
        f"if (s !== {rounds * calls * (calls - 1) // 2}) throw new Error('wrong sum ' + s);\n"
    )


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100]."""
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def cpu_ticks(pid: int) -> int | None:
    """User + system CPU clock ticks used so far by every thread of ``pid`` (None off Linux)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


async def quiesce(pids: list[int], idle: float = 0.03, limit: float = 3.0) -> None:
    """Wait until ``pids`` used no CPU for ``idle`` seconds (e.g. a worker pool was refilled)."""
    last = [cpu_ticks(pid) for pid in pids]
    if not pids or None in last:
        await asyncio.sleep(0.1)
        return
    now = time.perf_counter()
    quiet_since, deadline = now, now + limit
    while now < deadline:
        await asyncio.sleep(0.005)
        ticks, now = [cpu_ticks(pid) for pid in pids], time.perf_counter()
        if ticks != last:
            last, quiet_since = ticks, now
        elif now - quiet_since >= idle:
            return


def progress(message: str) -> None:
    """A progress line on stderr (stdout carries only the table)."""
    print(f"  .. {message}", file=sys.stderr, flush=True)


def only_text(response: RuntimeResponse) -> str:
    """The single text item of a successfully completed cell."""
    assert isinstance(response, Result), response
    assert response.error_text is None, response.error_text
    items = response.content_items
    assert len(items) == 1, items
    assert isinstance(items[0], InputText), items
    return items[0].text
