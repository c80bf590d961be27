"""A hostile cell must neither wedge nor crash the engine for other sessions, and gets a clear outcome.

Every case follows the same script:

1. session B (a *bystander*) starts a cell that loops ``await tools.echo({i})`` + a 5 ms timer
   until its delegate answers ``stop``;
2. the hostile cell runs in session A (same harness, so the same engine or host process) and must
   reach an outcome within its time bound; the case checks that outcome;
3. B kept making progress while A ran (no gap of more than ``MAX_GAP`` seconds between its tool
   calls), its running cell completes correctly within 5 s of A's outcome, and a fresh cell in B
   (and one in A) still works.

Whatever reaches Python (items, error texts, tool inputs, notifications) must be valid Unicode: a
lone surrogate may not cross (the new engine replaces it with U+FFFD).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from codemode.protocol import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    InputText,
    LiveCell,
    Result,
    Terminated,
    WaitRequest,
    Yielded,
)
from codemode.runtime import engine as engine_module
from codemode.session import (
    CancellationToken,
    CodeModeSession,
)
from tests.contract.delegate import FIXTURE_TOOLS, RecordingDelegate
from tests.sandbox.conftest import Canary, Harness, assert_no_escape, finish, strings_of, texts

#: The longest pause the bystander may make while the hostile cell runs (seconds).
MAX_GAP = 5.0
#: How long the bystander may take to finish once the hostile cell has its outcome (seconds).
AFTERWARDS = 5.0
MIB = 1024 * 1024

BYSTANDER = """
let i = 0;
for (;;) {
  const r = await tools.echo({i});
  if (r.i !== i) throw new Error('wrong echo ' + JSON.stringify(r));
  if (r.stop) break;
  await new Promise((resolve) => setTimeout(resolve, 5));
  i++;
}
text('bystander done after ' + i);
"""


@dataclass
class GatedDelegate(RecordingDelegate):
    """``echo`` answers ``stop: true`` once ``stop`` is set; every call's time is recorded."""

    stop: bool = False
    #: Seconds each ``echo`` takes (keeps many calls pending at once).
    echo_delay: float = 0.0
    stamps: list[float] = field(default_factory=list)

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        self.stamps.append(time.monotonic())
        if self.echo_delay and invocation.tool_name.name == "echo":
            await asyncio.sleep(self.echo_delay)
        result = await super().invoke_tool(invocation, cancellation)
        if invocation.tool_name.name == "echo" and isinstance(result, dict):
            return {**result, "stop": self.stop}
        return result


class Bystander:
    """Session B and its running cell."""

    def __init__(self, session: CodeModeSession, delegate: GatedDelegate, cell: CellId) -> None:
        self.session = session
        self.delegate = delegate
        self.cell = cell

    @classmethod
    async def start(cls, harness: Harness) -> Bystander:
        delegate = GatedDelegate()
        session = await harness.session(delegate)
        started = await session.execute(
            ExecuteRequest(
                tool_call_id="bystander",
                source=BYSTANDER,
                enabled_tools=list(FIXTURE_TOOLS),
                yield_time_ms=50,
            )
        )
        response = await asyncio.wait_for(started.initial_response(), 10)
        assert isinstance(response, Yielded), response
        bystander = cls(session, delegate, started.cell_id)
        await bystander.progress()
        return bystander

    async def progress(self, calls: int = 3, timeout: float = MAX_GAP) -> None:
        """The running cell makes ``calls`` more tool calls within ``timeout`` seconds."""
        target = len(self.delegate.stamps) + calls
        deadline = time.monotonic() + timeout
        while len(self.delegate.stamps) < target:
            assert time.monotonic() < deadline, "the bystander's running cell made no progress"
            await asyncio.sleep(0.01)

    def max_gap(self, since: float, until: float) -> float:
        """The longest stretch without a bystander tool call in ``[since, until]``."""
        points = [since, *(t for t in self.delegate.stamps if since < t < until), until]
        return max(b - a for a, b in itertools.pairwise(points))

    async def complete(self) -> None:
        """Stop the running cell; it completes correctly within AFTERWARDS seconds."""
        self.delegate.stop = True

        async def outcome() -> Result:
            while True:
                waited = await self.session.wait(WaitRequest(self.cell, 10_000))
                assert isinstance(waited, LiveCell), waited
                if isinstance(waited.response, Result):
                    return waited.response
                assert isinstance(waited.response, Yielded), waited.response

        result = await asyncio.wait_for(outcome(), AFTERWARDS)
        assert result.error_text is None, (
            f"the bystander's running cell failed: {result.error_text}"
        )
        (line,) = texts(result)
        assert line.startswith("bystander done after "), line

    async def fresh(self) -> None:
        result = await finish(self.session, 'text("fresh")', timeout=AFTERWARDS)
        assert (result.content_items, result.error_text) == ([InputText("fresh")], None)


def all_valid_unicode(result: Result, delegate: RecordingDelegate) -> None:
    """No lone surrogate reached Python: items, error text, tool inputs, notifications."""
    values: list[Any] = [result, [call.input for call in delegate.calls], delegate.notifications]
    for value in values:
        for text in strings_of(value):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                pytest.fail(f"a lone surrogate reached Python: {text[:200]!r} ({error})")


# -- the cases -----------------------------------------------------------------------------------

Check = Callable[[Result, RecordingDelegate], None]


def ok(*expected: str) -> Check:
    def check(result: Result, delegate: RecordingDelegate) -> None:
        assert result.error_text is None, result.error_text
        assert texts(result) == list(expected)

    return check


def completes(result: Result, delegate: RecordingDelegate) -> None:
    """Any outcome will do, as long as there is one (the script already has a Result)."""


def fails(*words: str) -> Check:
    def check(result: Result, delegate: RecordingDelegate) -> None:
        assert result.error_text is not None, f"expected an error, got {texts(result)[:5]}"
        for word in words:
            assert word in result.error_text.lower(), result.error_text[:500]

    return check


def ends_with_line(suffix: str) -> Check:
    def check(result: Result, delegate: RecordingDelegate) -> None:
        assert result.error_text is None, result.error_text
        assert texts(result)[-1].endswith(suffix), texts(result)[-5:]

    return check


@dataclass(frozen=True)
class Hostile:
    source: str
    check: Check
    heap: int | None = None
    timeout: float = 15.0
    #: A second cell in A after the hostile one; it must complete without error.
    after: str | None = None
    #: Seconds each of A's ``echo`` calls takes.
    echo_delay: float = 0.0


HEAP_16 = 16 * MIB

CASES: dict[str, Hostile] = {
    "lone_surrogate_text": Hostile(
        'text("a\\ud800b"); text("\\udc00"); text("ok")', ok("a\ufffdb", "\ufffd", "ok")
    ),
    "lone_surrogate_notify": Hostile(
        'notify("a\\ud800b"); notify({k: "\\udfff"}); text("sent")', ok("sent")
    ),
    "lone_surrogate_tool_args": Hostile(
        'const r = await tools.echo({s: "a\\ud800b", ["k\\udc00"]: [1, "\\ud83d"]}); '
        'await tools.patch("p\\ud800").catch(() => {}); text(typeof r)',
        completes,
    ),
    "lone_surrogate_store": Hostile(
        'store("k\\ud800", "v\\udc00"); store("plain", {x: "\\ud800", ["\\udfff"]: 1}); '
        'text(JSON.stringify(load("plain")).length > 0 ? "stored" : "?")',
        completes,
        after='text(JSON.stringify([load("k\\ud800"), load("plain")]).length > 0 ? "loaded" : "?")',
    ),
    "lone_surrogate_error": Hostile('text("x"); throw new Error("a\\ud800b")', fails()),
    "lone_surrogate_thrown_string": Hostile('throw "a\\udc00b"', fails()),
    "lone_surrogate_rejection": Hostile('await Promise.reject("\\ud800")', fails()),
    "lone_surrogate_image_url": Hostile(
        'try { image("data:image/png;base64,\\ud800") } catch (e) { text(String(e)) } '
        'try { image({image_url: "data:image/png;base64,A\\udc00", detail: "low"}) } '
        "catch (e) { text(String(e)) } "
        'try { audio("data:audio/mpeg;base64,\\ud800") } catch (e) { text(String(e)) }',
        completes,
    ),
    "lone_surrogate_tool_error": Hostile(
        "try { await tools.nope_\\u00e9() } catch (e) { text(String(e)) } "
        'try { await tools.echo("\\ud800") } catch (e) { text(String(e)) }',
        completes,
    ),
    "image_url_objects": Hostile(
        'try { image({image_url: {toString() { return "data:image/png;base64,AAA" }}}) } '
        "catch (e) { text('caught ' + e) }\n"
        'try { image({toString() { return "data:image/png;base64,AAA" }}) } '
        "catch (e) { text('caught ' + e) }\n"
        'try { audio({audio_url: {toString() { return "data:audio/mpeg;base64,AAAA" }}}) } '
        "catch (e) { text('caught ' + e) }\n"
        "image(5)",
        fails(),
    ),
    "store_keys_objects_symbols": Hostile(
        "try { store({toString() { return 'k' }}, 1) } catch (e) { text('caught ' + e) }\n"
        "try { store(Symbol('s'), 1) } catch (e) { text('caught ' + typeof e) }\n"
        "try { load(Symbol('s')) } catch (e) { text('caught ' + typeof e) }\n"
        "try { store({toString() { throw new Error('no') }}, 1) } catch (e) { text('caught') }\n"
        "try { store([1, [2]], 2) } catch (e) { text('caught ' + e) }\n"
        "text(String(load('k')) + ',' + String(load('1,2')))",
        ends_with_line("1,2"),
    ),
    "unhandled_rejections": Hostile(
        # runtime.md §2.5: a rejection nobody awaits is ignored.
        "tools.fail({}); Promise.reject(new Error('x')); (async () => { throw 'y' })();\n"
        "setTimeout(async () => { throw 'z' }, 0);\n"
        "await new Promise((resolve) => setTimeout(resolve, 50)); text('survived')",
        ok("survived"),
    ),
    "unhandled_rejections_naming_the_memory_limit": Hostile(
        # Their text used to be taken for the isolate's own report: the cell ended as over its
        # heap limit.
        "Promise.reject(new Error('Isolate was disposed during execution due to memory limit'));\n"
        "Promise.reject(new Error('page larger than the memory limit'));\n"
        "await new Promise((resolve) => setTimeout(resolve, 50)); text('survived')",
        ok("survived"),
    ),
    "heap_bomb": Hostile(
        "const a = []; while (true) a.push(new Array(1e6).fill(1))",
        fails("heap limit"),
        heap=HEAP_16,
    ),
    "string_heap_bomb": Hostile(
        "const parts = []; for (let i = 0; ; i++) parts.push('x'.repeat(1e6) + i)",
        fails(),
        heap=HEAP_16,
    ),
}

SLOW_CASES: dict[str, Hostile] = {
    "text_100m_characters": Hostile(
        'text("x".repeat(100_000_000))',
        fails("limit"),
        timeout=30,
    ),
    "text_1500_mib": Hostile(
        'const s = "x".repeat(1 << 20); for (let i = 0; i < 1500; i++) text(s)',
        fails("limit"),
        timeout=30,
    ),
    "array_buffers_towards_4_gib": Hostile(
        "const keep = [];\n"
        "for (let i = 0; i < 4096; i++) {\n"
        "  keep.push(new ArrayBuffer(1 << 20));\n"
        "  if (i % 256 === 0) text('MiB ' + i);\n"
        "}\n"
        "text('allocated ' + keep.length + ' MiB')",
        fails(),
        heap=HEAP_16,
        timeout=30,
    ),
    "typed_arrays_towards_4_gib": Hostile(
        "const keep = [];\n"
        "for (let i = 0; i < 256; i++) keep.push(new Float64Array(2 * 1024 * 1024));\n"
        "text('allocated ' + keep.length * 16 + ' MiB')",
        fails(),
        heap=HEAP_16,
        timeout=30,
    ),
    # Each echo takes 0.3 s, so all 5,000 are pending at once: a carrier that caps pending calls
    # may refuse some of A's, never B's.
    "parallel_tool_calls_5000": Hostile(
        "const rs = await Promise.allSettled(Array.from({length: 5000}, (_, i) => tools.echo({i})));\n"
        "text(rs.filter((r) => r.status === 'fulfilled').length + '/' + rs.length)",
        ends_with_line("/5000"),
        echo_delay=0.3,
    ),
    "notifications_10000": Hostile(
        "for (let i = 0; i < 10000; i++) notify('n' + i);\ntext('sent')",
        ok("sent"),
    ),
    "timers_100000": Hostile(
        "let n = 0;\n"
        "try { for (let i = 0; i < 100000; i++) setTimeout(() => { n++; }, 0); }\n"
        "catch (e) { text('refused: ' + e); }\n"
        "await new Promise((resolve) => setTimeout(resolve, 200));\n"
        "text('fired ' + n)",
        completes,
    ),
    "notify_100m_characters": Hostile('notify("x".repeat(100_000_000)); text("sent")', completes),
    "thrown_100m_characters": Hostile('throw "x".repeat(100_000_000)', fails()),
    # Each fits a frame alone, not both together: the end message was larger than the frame
    # Python accepts, which ended the engine and every cell on it.
    "store_writes_and_error_fill_a_frame_together": Hostile(
        # The most one cell may store (its key counts 256 characters more), 3 bytes a character.
        "store('k', '\\uffff'.repeat((64 << 20) - 4 - 256)); throw '\\x01'.repeat(16 << 20)",
        fails("store writes were discarded: they are too large to send"),
        timeout=60,
    ),
    "tool_argument_50m_characters": Hostile(
        'try { await tools.echo({s: "x".repeat(50_000_000)}) } catch (e) { text("refused") }',
        completes,
    ),
}


def _params() -> list[Any]:
    return [pytest.param(case, id=name) for name, case in CASES.items()] + [
        pytest.param(case, id=name, marks=[pytest.mark.slow, pytest.mark.timeout(120)])
        for name, case in SLOW_CASES.items()
    ]


@pytest.mark.parametrize("case", _params())
async def test_hostile_cell_leaves_other_sessions_alone(
    harness: Harness, canary: Canary, case: Hostile
) -> None:
    bystander = await Bystander.start(harness)
    limits = CodeModeSessionCellExecutionLimits(max_heap_size_bytes=case.heap)
    delegate = GatedDelegate(echo_delay=case.echo_delay)
    session = await harness.session(delegate, limits=limits)

    began = time.monotonic()
    result = await finish(session, case.source, timeout=case.timeout)
    ended = time.monotonic()

    case.check(result, delegate)
    all_valid_unicode(result, delegate)
    assert_no_escape(canary, result, delegate)
    gap = bystander.max_gap(began, ended)
    assert gap <= MAX_GAP, f"the bystander stalled for {gap:.1f} s while the hostile cell ran"
    await bystander.complete()
    await bystander.fresh()
    if case.after is not None:
        after = await finish(session, case.after, timeout=AFTERWARDS * 2)
        assert after.error_text is None, after.error_text
        all_valid_unicode(after, delegate)
    again = await finish(session, 'text("A alive")', timeout=AFTERWARDS * 2)
    assert (again.content_items, again.error_text) == ([InputText("A alive")], None)


async def test_runaway_loop_is_terminated_and_others_run_meanwhile(harness: Harness) -> None:
    bystander = await Bystander.start(harness)
    session = await harness.session()
    started = await session.execute(
        ExecuteRequest(tool_call_id="loop", source="while (true) {}", yield_time_ms=100)
    )
    response = await asyncio.wait_for(started.initial_response(), 10)
    assert response == Yielded(started.cell_id, [])
    # The loop spins: the bystander keeps going meanwhile, for a good while.
    began = time.monotonic()
    await bystander.progress(calls=20)
    await asyncio.sleep(0.5)
    await bystander.progress(calls=3)
    assert bystander.max_gap(began, time.monotonic()) <= MAX_GAP
    outcome = await asyncio.wait_for(session.terminate(started.cell_id), 5)
    assert outcome == LiveCell(Terminated(started.cell_id, []))
    await bystander.progress()
    await bystander.complete()
    await bystander.fresh()
    again = await finish(session, 'text("A alive")', timeout=AFTERWARDS * 2)
    assert (again.content_items, again.error_text) == ([InputText("A alive")], None)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_many_runaway_cells_at_once(harness: Harness) -> None:
    # A session that starts a pile of spinning cells gets them all stopped; others go on.
    bystander = await Bystander.start(harness)
    session = await harness.session()
    cells = []
    for index in range(8):
        started = await session.execute(
            ExecuteRequest(tool_call_id=f"loop-{index}", source="for (;;) {}", yield_time_ms=10)
        )
        response = await asyncio.wait_for(started.initial_response(), 10)
        assert isinstance(response, Yielded), response
        cells.append(started.cell_id)
    await bystander.progress(calls=5)
    for cell in cells:
        outcome = await asyncio.wait_for(session.terminate(cell), 5)
        assert outcome == LiveCell(Terminated(cell, []))
    await bystander.complete()
    await bystander.fresh()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG], ids=["info", "debug"])
def test_an_engines_stderr_flood_costs_the_loop_no_record_per_line(
    caplog: pytest.LogCaptureFixture, level: int
) -> None:
    # Guards: engine.py reads the engine's stderr as fast as it writes, and logs at most
    # MAX_LOG_LINES_PER_READ of its lines per read (none unless DEBUG is on). An engine that
    # wrote a line per byte held the event loop every session shares for 0.1 s per read, making
    # a log record per line whether it was logged or not.
    caplog.set_level(level, logger="codemode.runtime.engine")
    log = engine_module._EngineLog()
    began = time.perf_counter()
    for _ in range(20):
        log.data_received(b"\n" * 262_144)
    spent = time.perf_counter() - began
    records = [r for r in caplog.records if r.name == "codemode.runtime.engine"]
    if level == logging.DEBUG:
        assert len(records) == 20 * engine_module.MAX_LOG_LINES_PER_READ
    else:
        assert records == []
    assert spent < 0.5, spent  # the flood made 5.2 M records in about 2 s
