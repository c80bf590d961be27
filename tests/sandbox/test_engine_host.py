"""The engine's main thread (``host.js``) does not trust its isolate.

The prelude is the only code in an isolate that holds the host callback, and it checks what a cell
asks of it; ``host.js`` checks the same things again, out of the isolate's reach. These tests take
the prelude's checks away: each engine runs a prelude that hands the cell the raw callback
(``__host``) and counts the timers fired into the isolate (``__fired``), so that the cell speaks
to ``host.js`` as a subverted prelude would. What ``host.js`` refuses must then be refused quietly
(the engine, and every other cell on it, goes on), and what it bounds must stay bounded.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from codemode.protocol import InputImage, InputText, LiveCell, Result, WaitRequest
from codemode.protocol.types import ImageDetail
from codemode.runtime import LocalSession, LocalSessionProvider
from codemode.runtime import engine as engine_module
from codemode.runtime.cell import MAX_NOTIFICATIONS_PER_CELL
from codemode.runtime.engine import MAX_WRITE_ENTRIES, WRITES_TOO_MANY
from tests.contract.delegate import RecordingDelegate
from tests.sandbox.conftest import start, texts

pytestmark = pytest.mark.timeout(60)

_PRELUDE_HEAD = "(function installPrelude(host, wrapColumns) {\n  'use strict';\n"
_ENTRY_HEAD = "  return function entry(kind, a, b, c) {\n"


@pytest.fixture
async def session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[LocalSession, RecordingDelegate]]:
    js = tmp_path / "js"
    shutil.copytree(engine_module.JS_DIR, js)
    prelude = (js / "prelude.js").read_text()
    assert _PRELUDE_HEAD in prelude and _ENTRY_HEAD in prelude, "the prelude changed its shape"
    prelude = prelude.replace(_PRELUDE_HEAD, _PRELUDE_HEAD + "  globalThis.__host = host;\n")
    prelude = prelude.replace(
        _ENTRY_HEAD,
        _ENTRY_HEAD
        + "    if (kind === 'timer') globalThis.__fired = (globalThis.__fired || 0) + 1;\n",
    )
    (js / "prelude.js").write_text(prelude)
    monkeypatch.setattr(engine_module, "JS_DIR", js)
    delegate = RecordingDelegate()
    async with LocalSessionProvider() as provider:
        yield await provider.create_session(delegate), delegate


async def run(session: LocalSession, source: str) -> Result:
    # Every cell first proves that it holds the raw callback, or the test would prove nothing.
    _, response = await start(session, "text(typeof __host);\n" + source)
    assert isinstance(response, Result), response
    assert texts(response)[:1] == ["function"], response
    return response


async def run_forged(session: LocalSession, source: str) -> Result:
    """Run ``source`` on the session's running engine; check that the engine (the process the
    cells before and after it run in) went on, and that the cell ended without an error."""
    await run(session, "")
    assert session.engine is not None
    pid = session.engine.pid
    response = await run(session, source)
    assert response.error_text is None, response
    assert session.engine is not None and session.engine.pid == pid
    assert texts(await run(session, 'text("next")')) == ["function", "next"]
    return response


async def test_forged_media_items_are_dropped_or_mended_and_the_engine_goes_on(
    session: tuple[LocalSession, RecordingDelegate],
) -> None:
    # Guards: host.js lets only data: URLs out as images or audio, only the item kinds it knows,
    # and only known image details. Python ends an engine that sends anything else (with every
    # cell on it): without host.js's checks this cell would end as a crash.
    live, _ = session
    response = await run_forged(
        live,
        """
        __host(0, 'input_image', 'https://attacker.example/leak', 'low');
        __host(0, 'input_audio', 'file:///etc/passwd');
        __host(0, 'input_file', 'data:text/plain;base64,AAA');
        __host(0, 'input_text', 42);
        __host(0, 'input_image', 'data:image/png;base64,AAA', 'bogus');
        text('after');
        """,
    )
    assert response.content_items == [
        InputText("function"),
        InputImage("data:image/png;base64,AAA", ImageDetail.HIGH),
        InputText("after"),
    ]


async def test_forged_calls_host_js_cannot_vouch_for_are_dropped(
    session: tuple[LocalSession, RecordingDelegate],
) -> None:
    # Guards: host.js sends a call only with a string id of at most 64 characters and an integer
    # tool index. Python ends an engine whose call breaks either (with every cell on it).
    live, delegate = session
    response = await run_forged(
        live,
        """
        __host(1, 5, 0, '{}');
        __host(1, 'x'.repeat(65), 0, '{}');
        __host(1, 'y', 1.5, '{}');
        __host(1, 'z', 2 ** 60, '{}');
        text('after');
        """,
    )
    assert texts(response) == ["function", "after"]
    assert delegate.calls == []


# Guards, (1): host.js keeps at most 10,000 pending timers per cell, as the prelude does: each is
# a Node timer on the engine's main thread, outside the isolate's heap limit, and a subverted
# prelude could otherwise set millions (the cell's own timer takes one of the 10,000; the forged
# ones fire after all of them were set: the bound is on timers pending at once). (2): host.js
# clears the timer an id already has before it sets another under that id; a replaced timer left
# running would fire into the isolate all the same, unaccounted for.
@pytest.mark.parametrize(
    ("forge", "fired"),
    [
        ("for (let i = 1; i <= 10050; i++) __host(5, 1000000 + i, 500);", "10000"),
        ("for (let i = 0; i < 3; i++) __host(5, 777, 300);", "2"),  # once, and the cell's own
    ],
    ids=["bounded", "one-per-id"],
)
async def test_forged_timers_stay_bounded_and_one_per_id(
    session: tuple[LocalSession, RecordingDelegate], forge: str, fired: str
) -> None:
    live, _ = session
    source = (
        "const waited = new Promise((resolve) => setTimeout(resolve, 2000));\n"
        f"{forge}\nawait waited;\ntext(String(globalThis.__fired));"
    )
    response = await run_forged(live, source)
    assert texts(response) == ["function", fired]


async def test_notifications_past_a_cells_bound_reach_no_delegate(
    session: tuple[LocalSession, RecordingDelegate],
) -> None:
    # Guards: Python hands the delegate at most 10,000 notifications per cell, the prelude's
    # bound checked again (cell.py): each costs the host a delegate callback (a frame to the
    # client of a remote session), and a subverted prelude would otherwise send them without end.
    live, delegate = session
    response = await run_forged(
        live, "for (let i = 0; i < 10050; i++) __host(2, 'n'); text('after');"
    )
    assert texts(response) == ["function", "after"]
    async with asyncio.timeout(30):
        while not delegate.closed:  # every callback of the cell has finished
            await asyncio.sleep(0.01)
    assert len(delegate.notifications) == MAX_NOTIFICATIONS_PER_CELL


async def test_requests_of_unknown_kinds_or_odd_arguments_are_ignored(
    session: tuple[LocalSession, RecordingDelegate],
) -> None:
    # Guards: host.js acts only on the kinds it numbers and on arguments of the types it expects
    # (a `yield` whose turn is no integer, for one, is a frame Python ends the engine for).
    live, delegate = session
    response = await run_forged(
        live,
        """
        __host(99); __host(-1, 'x'); __host('1', 'id', 0, '{}'); __host();
        __host(2, 42); __host(2, null);
        __host(3, 'x'); __host(3, 1.5); __host(3, 2 ** 60);
        __host(5, 'a', 1); __host(5, 1, '1'); __host(5, 1.5, 1); __host(6, 'x'); __host(6);
        __host(7, 'x'); __host(8, '[]');
        text('after');
        """,
    )
    assert texts(response) == ["function", "after"]
    assert delegate.notifications == []


async def test_a_call_id_already_pending_is_not_served_twice(
    session: tuple[LocalSession, RecordingDelegate],
) -> None:
    # Guards: Python serves a call id only once while it is pending in its cell (cell.py). The
    # prelude makes each id anew, host.js forwards any id: a second call under a pending id
    # replaced the first in the cell's table, so the first was never cancelled when its cell
    # ended (a tool waiting for that ran on, holding one of the session's callback slots, until
    # it returned by itself).
    live, delegate = session
    response = await run_forged(
        live,
        """
        __host(1, 'dup', 3, '{}');
        __host(1, 'dup', 3, '{}');
        __host(1, 'dup', 3, '{}');
        await new Promise((resolve) => setTimeout(resolve, 200));
        text('after');
        """,
    )
    assert texts(response) == ["function", "after"]
    assert [call.runtime_tool_call_id for call in delegate.calls] == ["dup"]
    assert delegate.cancelled == ["dup"]
    assert live.pending_calls == 0


# Guards: host.js sends only store writes Python can decode (a JSON array of [key, JSON text]
# string pairs, no lone surrogate escape), else the cell ends with its writes discarded. Python
# ends an engine whose writes it cannot decode, with every cell on it: a subverted prelude's
# `done` (or `exit` after a late store) took the session's other cells with it.
@pytest.mark.parametrize(
    "forge",
    [
        "__host(4, null, 'not json');",
        '__host(4, null, \'[["k","\\\\ud800"]]\');',  # a lone surrogate, escaped
        "__host(4, null, '[[\"k\",1]]');",  # a value that is not a string
        '__host(4, null, \'{"k":"1"}\');',
        "__host(4, null, '[]'); __host(7); __host(8, 'not json');",  # exit's writes
    ],
    ids=["not-json", "lone-surrogate", "not-a-text", "not-an-array", "exit"],
)
async def test_writes_python_cannot_decode_end_only_their_cell(
    session: tuple[LocalSession, RecordingDelegate], forge: str
) -> None:
    live, _ = session
    await run(live, "")
    assert live.engine is not None
    pid = live.engine.pid
    sibling, parked = await start(
        live, "await new Promise((r) => setTimeout(r, 1500)); text('on')", 50
    )
    assert not isinstance(parked, Result)
    response = await run(live, forge)
    assert response.error_text == "exec cell store writes were discarded: they are malformed"
    outcome = await live.wait(WaitRequest(sibling, 10_000))
    assert isinstance(outcome, LiveCell) and texts(outcome.response) == ["on"]
    assert live.engine is not None and live.engine.pid == pid


async def test_writes_of_more_entries_than_a_prelude_makes_are_refused_before_decoding(
    session: tuple[LocalSession, RecordingDelegate],
) -> None:
    # Guards: host.js and Python (engine.py, counted before anything is decoded) refuse writes of
    # more entries than the prelude can make. Each entry costs Python a few objects: 25 million
    # tiny ones, within a frame, held the event loop every session shares for seconds.
    live, _ = session
    response = await run(
        live,
        f"""
        const entries = [];
        for (let i = 0; i <= {MAX_WRITE_ENTRIES}; i++) entries.push(`["k${{i}}","0"]`);
        __host(4, null, '[' + entries.join(',') + ']');
        """,
    )
    assert response.error_text == WRITES_TOO_MANY
    assert texts(await run(live, "text(String(load('k0')))")) == ["function", "undefined"]
