"""Answers leave the host in arrival order when they complete at once, and ``session/open`` does
not wait for the session's engine (``docs/interop.md``; the same scripts beside the upstream host
are rows of ``test_upstream_wire_fidelity.py``). Driven by raw frames over ``memory_pair()``."""

from __future__ import annotations

import pytest

from codemode.protocol.v1.messages import (
    CellClosed,
    ExecuteInitialResponse,
    ExecutionStarted,
    OperationRequest,
    OperationResponse,
    SessionExecute,
    SessionOpen,
    SessionReady,
    SessionShutdown,
    SessionTerminate,
    SessionWait,
    WaitCompleted,
    WireError,
    WireExecuteRequest,
    WireOk,
    WireResultBody,
    WireRuntimeResponse,
    WireTerminated,
    WireWaitOutcome,
    WireWaitRequest,
)
from codemode.runtime import LocalSessionProvider
from codemode.runtime.session import EnginePool
from tests.host.test_v1 import S1, ok, serving

BLOCKED = "await new Promise(() => {})"


def execute(source: str, yield_ms: int = 2000, session: str = S1) -> SessionExecute:
    return SessionExecute(session, WireExecuteRequest("call-1", [], source, yield_ms, None))


def missing(cell: str) -> WaitCompleted:
    body = WireResultBody(cell, [], f"exec cell {cell} not found")
    return WaitCompleted(WireWaitOutcome(missing_cell=WireRuntimeResponse(result=body)))


@pytest.mark.timeout(30)
async def test_refusals_wait_behind_the_requests_read_before_them(
    provider: LocalSessionProvider,
) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        await client.open()
        client.send(
            OperationRequest(2, SessionWait(S1, WireWaitRequest("7", 100))),
            OperationRequest(3, execute("text(1)", session="zz")),
            OperationRequest(4, SessionTerminate(S1, "9")),
            OperationRequest(5, SessionOpen(S1)),
            OperationRequest(6, SessionOpen("s2")),
            OperationRequest(7, SessionShutdown("nope")),
        )
        answers = [await client.receive() for _ in range(6)]
        assert answers == [
            ok(2, missing("7")),
            OperationResponse(3, WireError("unknown code-mode session zz")),
            ok(4, missing("9")),
            OperationResponse(5, WireError("code-mode session ID `session-1` is already open")),
            ok(6, SessionReady("s2")),
            OperationResponse(7, WireError("unknown code-mode session nope")),
        ]


@pytest.mark.timeout(30)
async def test_an_execute_observes_its_cell_before_a_wait_read_with_it(
    provider: LocalSessionProvider,
) -> None:
    async with serving(provider) as served:
        client = served.client
        await client.handshake()
        client.send(
            OperationRequest(1, SessionOpen(S1)),
            OperationRequest(2, execute(BLOCKED, yield_ms=60_000)),
            OperationRequest(3, SessionWait(S1, WireWaitRequest("1", 100))),
        )
        assert await client.receive() == ok(1, SessionReady(S1))
        assert await client.receive() == ok(2, ExecutionStarted("1"))
        busy = WireError("exec cell 1 already has an active observer")
        assert await client.receive() == OperationResponse(3, busy)
        client.send(OperationRequest(4, SessionTerminate(S1, "1")))
        terminated = WireRuntimeResponse(terminated=WireTerminated("1", []))
        assert await client.receive() == ok(4, WaitCompleted(WireWaitOutcome(terminated)))
        assert await client.receive() == ExecuteInitialResponse(2, WireOk(terminated))
        assert await client.receive() == CellClosed(S1, "1")


@pytest.mark.timeout(30)
async def test_an_engine_that_cannot_start_fails_the_execute_not_the_open() -> None:
    async with LocalSessionProvider(warm_engines=0) as provider:
        await provider.pool.aclose()
        provider.pool = EnginePool(size=0, node="/nonexistent/node")
        async with serving(provider) as served:
            client = served.client
            await client.handshake()
            await client.open()
            client.send(OperationRequest(2, execute("text(1)")))
            answer = await client.receive()
            assert isinstance(answer, OperationResponse) and answer.id == 2
            assert isinstance(answer.result, WireError)
            assert "/nonexistent/node" in answer.result.message
            # The session stays usable: the next execute is answered (the same way) too.
            client.send(OperationRequest(3, execute("text(2)")))
            again = await client.receive()
            assert isinstance(again, OperationResponse) and again.id == 3
            assert isinstance(again.result, WireError)
