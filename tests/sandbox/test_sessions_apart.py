"""Sessions cannot see each other: stores, tools, cells, notifications and globals stay apart.

A is the hostile session, B the victim; both are opened from the same harness (so they share the
engine, or the ``codemode host --stdio`` child) and B always has a cell running while A probes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from codemode.protocol import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    ExecuteRequest,
    InputText,
    LiveCell,
    MissingCell,
    Result,
    Terminated,
    ToolDefinition,
    WaitRequest,
    Yielded,
)
from codemode.session import (
    CancellationToken,
    CodeModeSession,
)
from tests.contract.delegate import ECHO, RecordingDelegate, function_tool
from tests.polling import eventually
from tests.sandbox.conftest import Canary, Harness, assert_no_escape, finish, js, texts

SECRET = function_tool("secret", "B's secret tool")
FOREVER = "await new Promise(() => {})"


@dataclass
class SecretDelegate(RecordingDelegate):
    """B's delegate: serves ``secret`` (returns the canary token) and records who called it."""

    token: str = ""
    secret_calls: list[CodeModeNestedToolCall] = field(default_factory=list)

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        if invocation.tool_name.name == "secret":
            self.secret_calls.append(invocation)
            return {"secret": self.token}
        return await super().invoke_tool(invocation, cancellation)


async def start(
    session: CodeModeSession,
    source: str,
    tools: list[ToolDefinition],
    *,
    call_id: str,
    yield_ms: int = 100,
) -> tuple[CellId, Yielded | Result]:
    started = await session.execute(
        ExecuteRequest(
            tool_call_id=call_id, source=source, enabled_tools=tools, yield_time_ms=yield_ms
        )
    )
    response = await asyncio.wait_for(started.initial_response(), 10)
    assert isinstance(response, (Yielded, Result)), response
    return started.cell_id, response


async def still_running(session: CodeModeSession, cell: CellId) -> None:
    outcome = await asyncio.wait_for(session.wait(WaitRequest(cell, 50)), 10)
    assert outcome == LiveCell(Yielded(cell, [])), outcome


async def test_stores_are_per_session(harness: Harness, canary: Canary) -> None:
    a_delegate = RecordingDelegate()
    b_delegate = RecordingDelegate()
    a = await harness.session(a_delegate)
    b = await harness.session(b_delegate)
    stored = await finish(
        b, f"store('secret', {js(canary.token)}); store('shared', 'B'); store(7, {{b: true}})"
    )
    assert stored.error_text is None, stored.error_text
    # B keeps a cell running that holds the store snapshot while A looks.
    b_cell, response = await start(
        b, f"text(String(load('secret') !== undefined)); {FOREVER}", [ECHO], call_id="b"
    )
    assert response == Yielded(b_cell, [InputText("true")])

    looked = await finish(
        a,
        "const keys = ['secret', 'shared', '7', 7, 'undefined', '', '__proto__', 'constructor'];\n"
        "text(JSON.stringify(keys.map((k) => [String(k), load(k) === undefined])));\n"
        "store('shared', 'A');",
        tools=[ECHO],
    )
    assert looked.error_text is None, looked.error_text
    assert texts(looked) == [
        '[["secret",true],["shared",true],["7",true],["7",true],["undefined",true],'
        '["",true],["__proto__",true],["constructor",true]]'
    ]
    assert_no_escape(canary, looked, a_delegate)

    theirs = await finish(b, "text(JSON.stringify([load('shared'), load(7)]))")
    assert texts(theirs) == ['["B",{"b":true}]']
    mine = await finish(a, "text(String(load('shared')))", tools=[ECHO])
    assert texts(mine) == ["A"]
    await still_running(b, b_cell)
    assert await b.terminate(b_cell) == LiveCell(Terminated(b_cell, []))


async def test_tools_are_per_session(harness: Harness, canary: Canary) -> None:
    a_delegate = RecordingDelegate(enabled=[ECHO])
    b_delegate = SecretDelegate(enabled=[ECHO, SECRET], token=canary.token)
    a = await harness.session(a_delegate)
    b = await harness.session(b_delegate)
    # B has a cell running with its secret tool enabled (it does not call it).
    b_cell, response = await start(
        b, f"text(typeof tools.secret); {FOREVER}", [ECHO, SECRET], call_id="b"
    )
    assert response == Yielded(b_cell, [InputText("function")])

    probe = """
const seen = [typeof tools.secret, typeof tools['secret'], 'secret' in tools,
              JSON.stringify(ALL_TOOLS), Object.keys(tools).join(',')];
for (const attempt of [() => tools.secret({}), () => tools['secret']({}),
                       () => tools.echo.call({name: 'secret'}, {tool: 'secret'}),
                       () => new Proxy(tools, {})['secret']({})]) {
  try { seen.push('called ' + JSON.stringify(await attempt())); }
  catch (e) { seen.push('refused'); }
}
seen.push(JSON.stringify(await tools.echo({ok: 1})));
text(JSON.stringify(seen));
"""
    looked = await finish(a, probe, tools=[ECHO])
    assert looked.error_text is None, looked.error_text
    assert texts(looked) == [
        '["undefined","undefined",false,"[{\\"name\\":\\"echo\\",\\"description\\":'
        '\\"Echo tool\\"}]","echo","refused","refused","called {\\"tool\\":\\"secret\\"}",'
        '"refused","{\\"ok\\":1}"]'
    ]
    # Even a cell of A that enables a tool named `secret` reaches A's delegate, never B's.
    declared = await finish(
        a,
        "try { text(JSON.stringify(await tools.secret({}))) } catch (e) { text('refused ' + e) }",
        tools=[ECHO, SECRET],
    )
    assert texts(declared) == ["refused tool `secret` is not enabled in exec"]
    assert [call.tool_name.name for call in a_delegate.calls] == ["echo", "echo", "secret"]
    assert b_delegate.secret_calls == []
    assert b_delegate.calls == []
    assert_no_escape(canary, looked, declared, a_delegate)
    await still_running(b, b_cell)
    assert await b.terminate(b_cell) == LiveCell(Terminated(b_cell, []))


def missing(cell: CellId) -> MissingCell:
    return MissingCell(Result(cell, [], f"exec cell {cell} not found"))


async def test_cells_are_per_session(harness: Harness) -> None:
    a_delegate = RecordingDelegate(enabled=[ECHO])
    b_delegate = RecordingDelegate(enabled=[ECHO])
    a = await harness.session(a_delegate)
    b = await harness.session(b_delegate)
    b_first, response = await start(
        b, f"text('B1'); notify('from B'); {FOREVER}", [ECHO], call_id="b-call"
    )
    assert response == Yielded(b_first, [InputText("B1")])

    # A has no cell yet: B's cell id means nothing to A.
    assert await a.wait(WaitRequest(b_first, 50)) == missing(b_first)
    assert await a.terminate(b_first) == missing(b_first)
    await still_running(b, b_first)

    # A's own cells; their ids may well collide with B's.
    a_first, a_result = await start(
        a, "text('A1'); notify('from A')", [ECHO], call_id="a-call", yield_ms=10_000
    )
    assert a_result == Result(a_first, [InputText("A1")], None)
    a_second, response = await start(a, f"text('A2'); {FOREVER}", [ECHO], call_id="a-call")
    assert response == Yielded(a_second, [InputText("A2")])
    b_second, response = await start(b, f"text('B2'); {FOREVER}", [ECHO], call_id="b-call")
    assert response == Yielded(b_second, [InputText("B2")])

    # Whatever A waits on or terminates is A's own cell or nothing: B's cells never answer.
    for cell in (b_first, b_second):
        if cell == a_second:
            assert await a.wait(WaitRequest(cell, 50)) == LiveCell(Yielded(cell, []))
        else:
            assert await a.wait(WaitRequest(cell, 50)) == missing(cell)
    assert await a.terminate(a_second) == LiveCell(Terminated(a_second, []))
    for cell in (b_first, b_second):
        assert await a.terminate(cell) == missing(cell)
        await still_running(b, cell)

    assert await b.terminate(b_first) == LiveCell(Terminated(b_first, []))
    assert await b.terminate(b_second) == LiveCell(Terminated(b_second, []))
    await eventually(lambda: len(a_delegate.closed) == 2 and len(b_delegate.closed) == 2)
    assert a_delegate.closed == [str(a_first), str(a_second)]
    assert b_delegate.closed == [str(b_first), str(b_second)]
    assert a_delegate.notifications == [("a-call", str(a_first), "from A")]
    assert b_delegate.notifications == [("b-call", str(b_first), "from B")]


async def test_globals_do_not_leak_between_sessions_or_cells(harness: Harness) -> None:
    a = await harness.session()
    b = await harness.session()
    check = (
        "text(JSON.stringify([typeof globalThis.leaked, ({}).polluted, typeof [].push, "
        "[].push.toString().includes('native code'), JSON.stringify({x: 1}), "
        "typeof Object.prototype.then, Object.getOwnPropertyNames(Object.prototype).length]))"
    )
    b_cell, response = await start(
        b,
        "await new Promise((resolve) => setTimeout(resolve, 300));\n" + check,
        [ECHO],
        call_id="b",
        yield_ms=10,
    )
    assert response == Yielded(b_cell, [])
    baseline = await finish(b, check, tools=[ECHO])
    polluted = await finish(
        a,
        "globalThis.leaked = 1; Object.prototype.polluted = 'yes';\n"
        "Array.prototype.push = function () { return 'hijacked'; };\n"
        "JSON.stringify = () => 'hijacked'; Object.prototype.then = function (r) { r('hijacked'); };\n"
        "text('done')",
        tools=[ECHO],
    )
    assert texts(polluted) == ["done"]
    fresh_a = await finish(a, check, tools=[ECHO])
    fresh_b = await finish(b, check, tools=[ECHO])
    outcome = await asyncio.wait_for(b.wait(WaitRequest(b_cell, 10_000)), 10)
    assert isinstance(outcome, LiveCell) and isinstance(outcome.response, Result), outcome
    expected = texts(baseline)
    assert expected[0].startswith('["undefined",null,"function",true,"{\\"x\\":1}","undefined",')
    assert texts(fresh_a) == expected
    assert texts(fresh_b) == expected
    assert texts(outcome.response) == expected
