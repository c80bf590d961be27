"""Layer 2: what the engine process says is untrusted.

Frames are fed straight into the engine's reader (as if a compromised engine wrote them): anything
malformed ends that engine and its cells, never the Python process or another engine; well-formed
but unexpected messages are refused per call.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from codemode.protocol import (
    ContentItem,
    ExecuteRequest,
    InputText,
    Result,
)
from codemode.runtime import LocalSession, LocalSessionProvider, NodeEngine
from codemode.runtime import session as session_module
from codemode.runtime.engine import MAX_ENGINE_FRAME_BYTES, _EngineOutput, _HostProtocol
from codemode.session import CodeModeSessionDelegate, StartedCell
from tests.contract.delegate import FIXTURE_TOOLS, RecordingDelegate
from tests.wire import frame


class Events:
    """Records what the engine reports about one cell."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def on_started(self) -> None:
        self.seen.append(("started", None))

    def on_item(self, item: ContentItem) -> None:
        self.seen.append(("item", item))

    def on_call(self, call_id: str, tool: int, input_json: str | None, strings: Any = None) -> None:
        if strings is None:
            self.seen.append(("call", (call_id, tool, input_json)))
        else:  # a long input's strings came decoded
            self.seen.append(("call", (call_id, tool, input_json, strings)))

    def on_notify(self, text: str) -> None:
        self.seen.append(("notify", text))

    def on_yield(self, turn: int) -> None:
        self.seen.append(("yield", turn))

    def on_done(
        self,
        error: str | None,
        writes: list[tuple[str, str]],
        call: tuple[int, int, int] | None,
    ) -> None:
        self.seen.append(("done", (error, writes, call)))

    def on_exited(self, reason: str, detail: str | None) -> None:
        self.seen.append(("exited", reason))


class StubTransport:
    """Stands in for the child process: records that it was killed."""

    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    def close(self) -> None:
        pass

    def get_pid(self) -> int:
        return 0


def wired() -> tuple[NodeEngine, _EngineOutput, Events, StubTransport]:
    engine = NodeEngine()
    transport = StubTransport()
    engine._transport = transport  # type: ignore[assignment]
    events = Events()
    engine._cells[1] = events
    return engine, _EngineOutput(engine), events, transport


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'[{"t":"item","cell":1,"type":"input_text","value":"a\\ud800b"}]',  # lone surrogate
        b'[{"t":"launch","cell":1}]',  # unknown message
        b'[{"t":"started","cell":1,"extra":true}]',  # unknown field
        b'[{"t":"started","cell":"1"}]',  # wrong type
        b'[{"t":"item","cell":1,"type":"input_video","value":"x"}]',  # unknown item type
        b'[{"t":"item","cell":1,"type":"input_image","value":"x","detail":"huge"}]',
        b'[{"t":"exited","cell":1,"reason":"vanished"}]',
        b'[{"t":"done","cell":1,"error":null,"writes":"[[\\"k\\", ]]"}]',  # writes not JSON
        b'[{"t":"done","cell":1,"error":"x","writes":"[]","call":[0,0,1]}]',  # line 0
        b'[{"t":"done","cell":1,"error":"x","writes":"[]","call":[0,1]}]',  # no column
        b'[{"t":"done","cell":1,"error":"x","writes":"[]","call":["fail",1,1]}]',  # a name
        b'{"t":"started","cell":1}',  # not a batch
        b"[" * 5000 + b"]" * 5000,  # nested past the decoder (RecursionError, not DecodeError)
        b'[{"t":"done","cell":1,"error":null,"writes":"[[\\"k\\",'
        + b"[" * 5000
        + b"]" * 5000
        + b']]"}]',
    ],
)
async def test_a_malformed_frame_ends_the_engine_and_its_cells(body: bytes) -> None:
    engine, protocol, events, transport = wired()
    protocol.data_received(frame(body))
    assert transport.killed
    assert events.seen[-1] == ("exited", "crashed")
    assert engine.live_cells == 0


async def test_an_oversize_frame_header_is_refused_before_buffering() -> None:
    _, protocol, events, transport = wired()
    protocol.data_received((MAX_ENGINE_FRAME_BYTES + 1).to_bytes(4, "little") + b"[")
    assert transport.killed
    assert events.seen == [("exited", "crashed")]


async def test_messages_for_unknown_cells_are_ignored() -> None:
    _, protocol, events, transport = wired()
    batch = [
        {"t": "item", "cell": 7, "type": "input_text", "value": "other"},
        {"t": "item", "cell": 1, "type": "input_text", "value": "mine"},
    ]
    protocol.data_received(frame(json.dumps(batch).encode()))
    assert not transport.killed
    assert events.seen == [("item", InputText("mine"))]


async def test_a_frame_split_anywhere_is_reassembled() -> None:
    _, protocol, events, _ = wired()
    data = frame(b'[{"t":"notify","cell":1,"text":"hello"}]') * 2
    for index in range(len(data)):
        protocol.data_received(data[index : index + 1])
    assert events.seen == [("notify", "hello"), ("notify", "hello")]


async def test_what_the_engine_wrote_before_it_exited_is_dispatched_before_its_end() -> None:
    # The exit can be reported before the loop read the child's last frames (e.g. a cell's
    # `exited` before a runaway isolate ends the process): they are read first.
    engine, protocol, events, _ = wired()
    read_end, write_end = os.pipe()
    loop = asyncio.get_running_loop()
    output, _ = await loop.connect_read_pipe(lambda: protocol, os.fdopen(read_end, "rb", 0))
    engine._output = output
    engine._reader = protocol
    os.write(write_end, frame(b'[{"t":"notify","cell":1,"text":"last words"}]'))
    os.close(write_end)
    _HostProtocol(engine).process_exited()
    assert events.seen == [("notify", "last words"), ("exited", "crashed")]
    assert output.is_closing()


async def parked_cell(
    provider: LocalSessionProvider, delegate: RecordingDelegate
) -> tuple[LocalSession, StartedCell, NodeEngine, int]:
    """A session with one cell waiting forever: the session, the cell, its engine and key."""
    session = await provider.create_session(delegate)
    started = await session.execute(
        ExecuteRequest(
            tool_call_id="c",
            source="await new Promise(() => {})",
            enabled_tools=list(FIXTURE_TOOLS),
            yield_time_ms=60_000,
        )
    )
    engine = session.engine
    assert engine is not None
    return session, started, engine, next(iter(engine._cells))


async def test_a_forged_call_to_a_tool_the_cell_does_not_have_is_refused() -> None:
    async with LocalSessionProvider() as provider:
        delegate = RecordingDelegate()
        session, started, engine, key = await parked_cell(provider, delegate)
        answers: list[tuple[str, bool, Any]] = []
        real = engine.send_result

        def record(key: int, call_id: str, ok: bool, value: Any, *, alone: bool = False) -> None:
            answers.append((call_id, ok, value))

        engine.send_result = record  # type: ignore[method-assign]
        forged = [
            {"t": "call", "cell": key, "id": "x1", "tool": 99, "input": None},
            {"t": "call", "cell": key, "id": "x2", "tool": -1, "input": None},
            {"t": "call", "cell": key, "id": "x3", "tool": 0, "input": "{not json"},
            {"t": "call", "cell": key, "id": "x4", "tool": 0, "input": "[" * 5000 + "]" * 5000},
        ]
        _EngineOutput(engine).data_received(frame(json.dumps(forged).encode()))
        engine.send_result = real  # type: ignore[method-assign]
        assert answers == [
            ("x1", False, "unknown tool"),
            ("x2", False, "unknown tool"),
            ("x3", False, "tool input is not JSON"),
            ("x4", False, "tool input is not JSON"),  # deeper than the prelude sends
        ]
        assert delegate.calls == []
        await session.terminate(started.cell_id)


async def test_a_forged_call_site_naming_no_tool_of_the_cell_is_dropped() -> None:
    async with LocalSessionProvider() as provider:
        _, started, engine, key = await parked_cell(provider, RecordingDelegate())
        forged = [{"t": "done", "cell": key, "error": "boom", "writes": "[]", "call": [99, 1, 1]}]
        _EngineOutput(engine).data_received(frame(json.dumps(forged).encode()))
        result = await asyncio.wait_for(started.initial_response(), 10)
        assert result == Result(started.cell_id, [], "boom")
        assert isinstance(result, Result) and result.failed_call is None


async def test_writes_repeating_a_key_are_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The store's size was counted per write against the store before the writes: a key written
    # again and again took its old size off each time, and the store outgrew its limit.
    monkeypatch.setattr(session_module, "MAX_STORE_CHARS", 1000)

    def raw(*writes: tuple[str, str]) -> list[tuple[str, str]]:
        return list(writes)

    async with LocalSessionProvider() as provider:
        session = await provider.create_session(RecordingDelegate())
        stored = json.dumps("x" * 397)
        assert await session.commit(raw(("k", stored)), lambda: True) is None
        forged = raw(("k", "1"), ("k", "1"), ("j", json.dumps("y" * 498)), ("k", stored))
        assert await session.commit(forged, lambda: True) == (
            "exec cell store writes were discarded: the session store would exceed 1000 characters"
        )
        # k: 1 + 399 + 256 for its entry; j: 1 + 1 + 256.
        assert (
            await session.commit(raw(("k", "1"), ("k", stored), ("j", "2")), lambda: True) is None
        )


async def test_writes_merged_off_the_loop_are_those_merged_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Many writes are merged on a worker thread; the same writes merged on the loop (below the
    # threshold) leave the same store, and a commit no longer wanted leaves it as it was.
    async def committed(threshold: int, wanted: bool) -> dict[str, str]:
        monkeypatch.setattr(session_module, "THREAD_WRITES", threshold)
        async with LocalSessionProvider() as provider:
            session = await provider.create_session(RecordingDelegate())
            writes = [(f"k{i % 3000}", str(i)) for i in range(5000)]
            assert await session.commit(writes, lambda: wanted) is None
            return dict(session._store)

    on_loop, off_loop = await committed(10**9, True), await committed(1, True)
    assert on_loop == off_loop
    assert len(on_loop) == 3000 and on_loop["k0"] == "3000" and on_loop["k2999"] == "2999"
    assert await committed(1, False) == {}


@pytest.mark.slow
async def test_a_large_tool_result_reaches_the_cell_in_linear_time() -> None:
    class Big(CodeModeSessionDelegate):
        async def invoke_tool(self, invocation: Any, token: Any) -> Any:
            return "z" * (48 * 1024 * 1024)

    async with LocalSessionProvider() as provider:
        session = await provider.create_session(Big())
        started = await session.execute(
            ExecuteRequest(
                tool_call_id="c",
                source="text(String((await tools.echo()).length))",
                enabled_tools=list(FIXTURE_TOOLS),
            )
        )
        result = await asyncio.wait_for(started.initial_response(), 20)
        assert result == Result(started.cell_id, [InputText(str(48 * 1024 * 1024))], None)


async def test_large_writes_decoded_off_the_loop_keep_the_order_and_the_checks() -> None:
    # Writes of THREAD_CHARS or more are counted and decoded on a worker thread while the
    # engine's later messages wait: they come after the cell's end all the same, and malformed
    # ones are still a breach.
    from codemode.runtime.engine import THREAD_CHARS

    value = json.dumps("x" * THREAD_CHARS)
    _, protocol, events, transport = wired()
    batch = [
        {"t": "done", "cell": 1, "error": None, "writes": json.dumps([["k", value]])},
        {"t": "exited", "cell": 1, "reason": "stopped"},
    ]
    protocol.data_received(frame(json.dumps(batch).encode()))
    assert events.seen == []  # on its way
    async with asyncio.timeout(5):
        while len(events.seen) < 2:
            await asyncio.sleep(0.01)
    assert events.seen == [("done", (None, [("k", value)], None)), ("exited", "stopped")]
    assert not transport.killed

    _, protocol, events, transport = wired()
    malformed = '[["k", ' + "[" * THREAD_CHARS + "]]"
    batch = [{"t": "done", "cell": 1, "error": None, "writes": malformed}]
    protocol.data_received(frame(json.dumps(batch).encode()))
    async with asyncio.timeout(5):
        while not transport.killed:
            await asyncio.sleep(0.01)
    assert events.seen == [("exited", "crashed")]
