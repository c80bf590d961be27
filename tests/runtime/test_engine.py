"""The embedded engine: crash recovery, isolation from Node, limits refused up front."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import pytest

from codemode.errors import CodeModeError, WireConversionError
from codemode.protocol import (
    JSON,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ExecuteRequest,
    InputText,
    Result,
    ToolDefinition,
    ToolName,
)
from codemode.runtime import InvalidLimitsError, LocalSession, LocalSessionProvider, NodeEngine
from codemode.session import (
    CancellationToken,
    CodeModeSessionDelegate,
)


async def run(
    provider: LocalSessionProvider, source: str, session: LocalSession | None = None
) -> Result:
    session = session or await provider.create_session(CodeModeSessionDelegate())
    started = await session.execute(ExecuteRequest(tool_call_id="c", source=source))
    response = await started.initial_response()
    assert isinstance(response, Result)
    return response


def engine_pid(session: LocalSession) -> int:
    assert session.engine is not None and session.engine.pid is not None
    return session.engine.pid


async def test_engine_crash_ends_running_cells_and_the_next_cell_gets_a_new_engine(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session(CodeModeSessionDelegate())
    started = await session.execute(
        ExecuteRequest(
            tool_call_id="c", source='text("before"); while (true) {}', yield_time_ms=60_000
        )
    )
    await asyncio.sleep(0.2)
    os.kill(engine_pid(session), signal.SIGKILL)
    response = await asyncio.wait_for(started.initial_response(), 5)
    assert response == Result(
        started.cell_id, [InputText("before")], "exec runtime ended unexpectedly"
    )
    again = await run(provider, 'text("alive")', session)
    assert again.content_items == [InputText("alive")]


@pytest.mark.parametrize(
    "probe",
    [
        "text.constructor.constructor('return typeof process')()",
        "tools.constructor === Object ? typeof Function('return this')().process : 'x'",
        "(() => { try { image('https://x/y.png') } catch (e) { return typeof e } })()",
        "(() => { try { load.call(null, { toString() { throw new Error('k') } }) } "
        "catch (e) { return e.constructor.constructor('return typeof process')() } })()",
        "Object.getOwnPropertyNames(globalThis).filter(n => /^(host|require|module|Buffer|process)$|^__/.test(n)).join() || 'undefined'",
    ],
)
async def test_cells_cannot_reach_node(provider: LocalSessionProvider, probe: str) -> None:
    result = await run(provider, f"text(String({probe}))")
    assert result.error_text is None, result.error_text
    assert result.content_items in ([InputText("undefined")], [InputText("string")])


async def test_zero_heap_limit_is_refused(provider: LocalSessionProvider) -> None:
    with pytest.raises(InvalidLimitsError) as caught:
        await provider.create_session_with_limits(
            CodeModeSessionDelegate(), CodeModeSessionCellExecutionLimits(max_heap_size_bytes=0)
        )
    assert str(caught.value) == (
        "invalid code-mode session execution limits: max_heap_size_bytes must be greater than 0"
    )
    assert isinstance(caught.value, CodeModeError)


async def test_a_heap_limit_above_the_engine_cap_runs_cells(provider: LocalSessionProvider) -> None:
    # The largest limit the wire can carry (u64): the engine's memory cap bounds it (it used to
    # overflow the isolate's limit, and the cell died).
    session = await provider.create_session_with_limits(
        CodeModeSessionDelegate(),
        CodeModeSessionCellExecutionLimits(max_heap_size_bytes=2**64 - 1),
    )
    result = await run(provider, "text(new Array(1000).fill(7).length)", session)
    assert (result.content_items, result.error_text) == ([InputText("1000")], None)


async def test_many_cells_in_many_sessions_run_concurrently(provider: LocalSessionProvider) -> None:
    sessions = [await provider.create_session(CodeModeSessionDelegate()) for _ in range(4)]
    starts = [
        await session.execute(
            ExecuteRequest(
                tool_call_id="c",
                source=f'await new Promise(r => setTimeout(r, 100)); text("{index}:{cell}")',
            )
        )
        for index, session in enumerate(sessions)
        for cell in range(3)
    ]
    results = await asyncio.gather(*(started.initial_response() for started in starts))
    texts = sorted(item.text for result in results for item in result.content_items)  # type: ignore[union-attr]
    assert texts == sorted(f"{index}:{cell}" for index in range(4) for cell in range(3))


async def test_closed_provider_leaves_no_engine_process() -> None:
    provider = LocalSessionProvider()
    session = await provider.create_session(CodeModeSessionDelegate())
    await run(provider, "text(1)", session)
    pid = engine_pid(session)
    await provider.aclose()
    await asyncio.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
async def test_array_buffers_count_against_the_heap_limit(provider: LocalSessionProvider) -> None:
    session = await provider.create_session_with_limits(
        CodeModeSessionDelegate(), CodeModeSessionCellExecutionLimits(max_heap_size_bytes=16 << 20)
    )
    await run(provider, "text(1)", session)
    pid = engine_pid(session)
    base = peak = resident_bytes(pid)
    started = await session.execute(
        ExecuteRequest(
            tool_call_id="c",
            source="const kept = []; for (let i = 0; i < 64; i++) kept.push(new ArrayBuffer(64 << 20));",
        )
    )
    waiting = asyncio.ensure_future(started.initial_response())
    while not waiting.done():
        peak = max(peak, resident_bytes(pid))
        await asyncio.sleep(0.005)
    result = waiting.result()
    assert isinstance(result, Result)
    assert result.error_text is not None
    assert result.error_text.startswith("RangeError: Array buffer allocation failed")
    assert peak - base < 1 << 30
    assert (await run(provider, 'text("alive")', session)).content_items == [InputText("alive")]


async def test_an_engine_over_its_memory_cap_ends_its_cells() -> None:
    cap = 200 << 20
    async with LocalSessionProvider(memory_cap_bytes=cap) as capped:
        session = await capped.create_session(CodeModeSessionDelegate())
        result = await run(
            capped,
            "const kept = []; for (;;) kept.push(Array.from({length: 1000}, (_, i) => ({i})));",
            session,
        )
        assert result.error_text == f"exec cell exceeded the engine memory limit of {cap} bytes"
        again = await run(capped, 'text("fresh")', session)
        assert again.content_items == [InputText("fresh")]


async def test_sessions_get_engine_processes_of_their_own(provider: LocalSessionProvider) -> None:
    first = await provider.create_session(CodeModeSessionDelegate())
    second = await provider.create_session(CodeModeSessionDelegate())
    await run(provider, "text(1)", first)
    await run(provider, "text(1)", second)
    assert engine_pid(first) != engine_pid(second)


async def test_an_idle_session_gives_its_engine_back_and_keeps_its_store() -> None:
    async with LocalSessionProvider(idle_engine_timeout=0.05) as quick:
        session = await quick.create_session(CodeModeSessionDelegate())
        await run(quick, 'store("k", 41)', session)
        pid = engine_pid(session)
        for _ in range(200):
            if session.engine is None:
                break
            await asyncio.sleep(0.01)
        assert session.engine is None
        assert (await run(quick, 'text(load("k") + 1)', session)).content_items == [InputText("42")]
        assert engine_pid(session) != pid


async def test_a_shared_engine_serves_every_session() -> None:
    async with LocalSessionProvider(shared_engine=True) as shared:
        first = await shared.create_session(CodeModeSessionDelegate())
        second = await shared.create_session(CodeModeSessionDelegate())
        await run(shared, "text(1)", first)
        await run(shared, "text(1)", second)
        assert engine_pid(first) == engine_pid(second)


async def test_a_heap_bomb_of_small_arrays_is_stopped_and_the_session_goes_on(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session_with_limits(
        CodeModeSessionDelegate(), CodeModeSessionCellExecutionLimits(max_heap_size_bytes=32 << 20)
    )
    result = await asyncio.wait_for(
        run(provider, "const a = []; while (true) a.push(new Array(1000).fill(1));", session), 10
    )
    assert result.error_text == "exec cell exceeded the heap limit of 33554432 bytes"
    assert (await run(provider, 'text("next")', session)).content_items == [InputText("next")]


async def test_required_confinement_that_is_missing_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from codemode.runtime import confinement

    weak = confinement.ConfinementReport(
        permission_model=True, landlock_abi=0, landlock=False, seccomp=False
    )
    monkeypatch.setattr(confinement, "probe", lambda: weak)
    async with LocalSessionProvider(require_confinement=True, warm_engines=0) as strict:
        with pytest.raises(confinement.ConfinementError) as caught:
            await strict.create_session(CodeModeSessionDelegate())
    assert "landlock-fs" in str(caught.value) and "seccomp" in str(caught.value)
    async with LocalSessionProvider(warm_engines=0) as lenient:
        session = await lenient.create_session(CodeModeSessionDelegate())
        assert (await run(lenient, "text(1)", session)).content_items == [InputText("1")]
        assert session.engine is not None and session.engine.confinement == weak


async def test_a_result_reports_how_long_it_waited_for_its_observer(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session(CodeModeSessionDelegate())
    started = await session.execute(
        ExecuteRequest(tool_call_id="c", source="text(1)", yield_time_ms=10_000)
    )
    first = await started.initial_response()
    assert isinstance(first, Result) and first.result_buffered_for_ns == 0
    late = await session.execute(
        ExecuteRequest(
            tool_call_id="c",
            source="await new Promise(r => setTimeout(r, 20)); text(2)",
            yield_time_ms=0,
        )
    )
    assert not isinstance(await late.initial_response(), Result)
    await asyncio.sleep(0.3)
    from codemode.protocol import WaitRequest

    waited = await session.wait(WaitRequest(late.cell_id, 1000))
    assert isinstance(waited.response, Result)
    assert waited.response.result_buffered_for_ns is not None
    assert waited.response.result_buffered_for_ns >= 100_000_000


class _SurrogateDelegate(CodeModeSessionDelegate):
    """Fails ``bad`` with a text holding a lone surrogate; answers ``ok`` with its input."""

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        if invocation.tool_name.name == "bad":
            raise CodeModeError("no such file: caf\udce9.txt")
        return invocation.input


async def test_lone_surrogates_sent_to_the_engine_become_replacement_characters(
    provider: LocalSessionProvider,
) -> None:
    # Guards: what goes to the engine is made well-formed first. A lone surrogate cannot be
    # encoded as UTF-8: the frame holding it, and every other settlement in it, was lost, and
    # the cells waiting on them hung for ever.
    session = await provider.create_session(_SurrogateDelegate())
    tools = [
        ToolDefinition(name, ToolName.plain(name), "d", CodeModeToolKind.FUNCTION)
        for name in ("bad", "ok")
    ]
    source = (
        "const [a, b] = await Promise.allSettled([tools.bad({}), tools.ok({v: 1})]);\n"
        'text(String(a.reason)); text(JSON.stringify(b.value)); text("\\ud800|\\ud83d\\ude00")'
    )
    # A lone surrogate in the source itself is refused up front, as on every carrier
    # (tests/contract/test_bad_arguments.py); JavaScript escapes of surrogates are fine.
    with pytest.raises(WireConversionError):
        await session.execute(ExecuteRequest("c", source.replace("\\ud800", "\ud800"), tools))
    started = await session.execute(ExecuteRequest("c", source, tools, 10_000))
    response = await asyncio.wait_for(started.initial_response(), 10)
    assert isinstance(response, Result)
    assert response.error_text is None, response.error_text
    assert response.content_items == [
        InputText("no such file: caf\ufffd.txt"),
        InputText('{"v":1}'),
        InputText("\ufffd|\U0001f600"),
    ]


# A program that starts a cell in a loop for ever, prints its engine's pid, then waits.
_PARENT_OF_A_RUNAWAY_CELL = """
import asyncio
from codemode.protocol import ExecuteRequest
from codemode.runtime import LocalSessionProvider
from codemode.session import CodeModeSessionDelegate

async def main():
    provider = LocalSessionProvider()
    session = await provider.create_session(CodeModeSessionDelegate())
    started = await session.execute(
        ExecuteRequest(tool_call_id="c", source="while (true) {}", yield_time_ms=50)
    )
    await started.initial_response()
    print(session.engine.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
async def test_an_engine_dies_with_the_process_that_started_it() -> None:
    # Killed, the parent closes nothing: the engine's stdin ends, but its exit would wait for the
    # cell's thread, which never returns; it must not be left to spin a CPU for ever.
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PARENT_OF_A_RUNAWAY_CELL, stdout=asyncio.subprocess.PIPE
    )
    assert parent.stdout is not None
    try:
        pid = int(await asyncio.wait_for(parent.stdout.readline(), 30))
    finally:
        parent.kill()
        await parent.wait()
    for _ in range(100):
        if _exited(pid):
            break
        await asyncio.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the engine outlived the process that started it")


# Programs that fail right after starting a cell, while the engine may still be spawning:
# asyncio.run() then cancels the engine's start, and must end.
_FAILS_WHILE_THE_ENGINE_STARTS = """
import asyncio, sys
from codemode.protocol import ExecuteRequest
from codemode.runtime import LocalSessionProvider
from codemode.session import CodeModeSessionDelegate

async def main(delay):
    provider = LocalSessionProvider()
    session = await provider.create_session(CodeModeSessionDelegate())
    await session.execute(ExecuteRequest(tool_call_id="c", source="text(1)"))
    await asyncio.sleep(delay)
    raise LookupError("the program's own error")

for delay in (0, 0, 0.001, 0.003, 0.005, 0.01, 0.02):
    try:
        asyncio.run(main(delay))
    except LookupError:
        pass
print("ended")
"""


async def test_a_program_that_fails_while_its_engine_starts_ends() -> None:
    program = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _FAILS_WHILE_THE_ENGINE_STARTS,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(program.communicate(), 40)
    except TimeoutError:
        program.kill()
        await program.wait()
        pytest.fail("asyncio.run() hung on an engine start it cancelled")
    assert (program.returncode, out) == (0, b"ended\n"), err.decode()


async def test_an_engine_whose_stdin_ends_exits_by_itself_with_a_cell_in_a_loop(
    provider: LocalSessionProvider,
) -> None:
    # process.exit() waits for every isolate's thread: the engine must stop its isolates first,
    # or a cell in a loop for ever keeps an engine whose runtime is gone (spinning a CPU). And it
    # must not exit while a stopped isolate's thread still unwinds: that crashed it (SIGSEGV) in
    # about one engine of four on a loaded machine, so several engines end here at once.
    transports = []
    for _ in range(4):
        session = await provider.create_session(CodeModeSessionDelegate())
        started = await session.execute(
            ExecuteRequest(tool_call_id="c", source="while (true) {}", yield_time_ms=50)
        )
        await started.initial_response()
        engine = session.engine
        assert engine is not None and engine._transport is not None and engine._stdin is not None
        transports.append((engine._transport, engine._stdin))
    for _, stdin in transports:
        stdin.close()  # the end of its input, with the cell still running
    for _ in range(100):
        if all(transport.get_returncode() is not None for transport, _ in transports):
            break
        await asyncio.sleep(0.05)
    else:
        for transport, _ in transports:
            transport.kill()
        pytest.fail("an engine did not exit at the end of its stdin")
    assert [transport.get_returncode() for transport, _ in transports] == [0, 0, 0, 0]


async def test_a_flood_of_small_messages_reaches_python_in_frames_of_at_most_1024(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python handles a frame's messages in the loop iteration that read it: 130,000 empty items
    # in one frame (8 MiB by the engine's estimate) held that loop for 0.3 s, which every
    # session of the process shares.
    sizes: list[int] = []
    dispatch = NodeEngine._dispatch

    def record(
        self: NodeEngine, batch: list[Any], start: int = 0, deadline: float | None = None
    ) -> int:
        if start == 0:  # a frame's first slice (a slice may dispatch part of a frame)
            sizes.append(len(batch))
        return dispatch(self, batch, start, deadline)

    monkeypatch.setattr(NodeEngine, "_dispatch", record)
    response = await run(
        provider,
        "for (let i = 0; i < 5000; i++) text(''); for (let i = 0; i < 3000; i++) notify('n')",
    )
    assert response.error_text is None
    assert len(response.content_items) == 5000
    assert sum(sizes) >= 8000
    assert max(sizes) <= 1024
