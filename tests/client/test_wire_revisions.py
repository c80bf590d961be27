"""Wire revisions end to end (decision 0007): conversions, the host machine, and our client
and host in each revision, matched and mismatched."""

from __future__ import annotations

import subprocess
import sys

import pytest

from codemode.client import DEFAULT_HOST_COMMAND, ProcessOwnedCodeModeSessionProvider
from codemode.errors import CodeModeError, WireConversionError
from codemode.protocol import (
    CellId,
    ExecuteRequest,
    InputText,
    LiveCell,
    Result,
    WaitRequest,
    Yielded,
)
from codemode.protocol.constants import U64_MAX
from codemode.protocol.types import ContentItem, MissingCell, Terminated
from codemode.protocol.v1 import WireRevision, encode_payload
from codemode.protocol.v1.conversions import (
    runtime_response_to_domain,
    runtime_response_to_wire,
    wait_outcome_to_wire,
)
from codemode.protocol.v1.host import HostProtocol
from codemode.protocol.v1.messages import (
    OperationRequest,
    SessionExecute,
    SessionOpen,
    WireExecuteRequest,
    WireResultBody,
    WireRuntimeResponse,
    WireYielded,
)
from tests.contract.delegate import RecordingDelegate
from tests.wire import hello

CELL = CellId("1")
ITEMS: list[ContentItem] = [InputText("hi")]


def test_pinned_conversion_writes_no_timing() -> None:
    timed = Result(CELL, ITEMS, None, host_duration_ns=5, result_buffered_for_ns=6)
    assert encode_payload(runtime_response_to_wire(timed)) == (
        b'{"Result":{"cell_id":"1","content_items":[{"type":"input_text","text":"hi"}],'
        b'"error_text":null}}'
    )


def test_latest_conversion_writes_both_fields_and_zero_when_untracked() -> None:
    timed = Result(CELL, [], "boom", host_duration_ns=5, result_buffered_for_ns=6)
    assert encode_payload(runtime_response_to_wire(timed, WireRevision.LATEST)) == (
        b'{"Result":{"cell_id":"1","content_items":[],"error_text":"boom",'
        b'"result_buffered_for_ns":6,"code_mode_host_duration_ns":5}}'
    )
    assert encode_payload(runtime_response_to_wire(Yielded(CELL), WireRevision.LATEST)) == (
        b'{"Yielded":{"cell_id":"1","content_items":[],"code_mode_host_duration_ns":0}}'
    )
    outcome = wait_outcome_to_wire(MissingCell(Terminated(CELL)), WireRevision.LATEST)
    assert encode_payload(outcome) == (
        b'{"MissingCell":{"Terminated":{"cell_id":"1","content_items":[],'
        b'"code_mode_host_duration_ns":0}}}'
    )


@pytest.mark.parametrize("value", [-1, U64_MAX + 1])
def test_latest_conversion_range(value: int) -> None:
    with pytest.raises(WireConversionError, match="out of range integral type conversion"):
        runtime_response_to_wire(Yielded(CELL, host_duration_ns=value), WireRevision.LATEST)
    assert runtime_response_to_wire(Yielded(CELL, host_duration_ns=value))  # pinned: not written


def test_domain_keeps_timing_but_equality_ignores_it() -> None:
    wire = WireResultBody("1", [], None, 7, 8)
    response = runtime_response_to_domain(WireRuntimeResponse(result=wire))
    assert isinstance(response, Result)
    assert (response.result_buffered_for_ns, response.host_duration_ns) == (7, 8)
    assert response == Result(CELL, [], None)
    pinned = runtime_response_to_domain(WireRuntimeResponse(yielded=WireYielded("1", [])))
    assert pinned.host_duration_ns is None
    assert Result(CELL).result_buffered_for_ns is None


@pytest.mark.parametrize(
    ("revision", "expected"),
    [
        (WireRevision.PINNED, b'"error_text":null}}}}'),
        (WireRevision.LATEST, b'"result_buffered_for_ns":0,"code_mode_host_duration_ns":9}}}}'),
    ],
)
def test_host_protocol_writes_the_configured_revision(
    revision: WireRevision, expected: bytes
) -> None:
    now = 0
    protocol = HostProtocol(wire_revision=revision, clock=lambda: now)
    protocol.receive(hello(()))
    protocol.receive(OperationRequest(1, SessionOpen("s")))
    protocol.session_opened(1)
    now = 100  # the execute arrives
    protocol.receive(
        OperationRequest(2, SessionExecute("s", WireExecuteRequest("c", [], "", None, None)))
    )
    protocol.execution_started(2, CELL)
    protocol.data_to_send()
    now = 109  # its initial response is ready 9 ns later
    protocol.initial_response(2, Result(CELL, [], None))
    ((data, _),) = protocol.data_to_send()
    assert bytes(data).endswith(expected)


def _command(revision: WireRevision) -> list[str]:
    return [*DEFAULT_HOST_COMMAND, "--wire-revision", revision.value]


async def test_latest_client_and_host_report_timings() -> None:
    provider = ProcessOwnedCodeModeSessionProvider(wire_revision="latest")
    assert provider.command[-2:] == ["--wire-revision", "latest"]
    async with provider:
        session = await provider.create_session(RecordingDelegate())
        source = 'text("a"); yield_control(); await new Promise(r => setTimeout(r, 50)); text("b")'
        started = await session.execute(ExecuteRequest("call-1", source, yield_time_ms=5000))
        first = await started.initial_response()
        assert first == Yielded(started.cell_id, [InputText("a")])
        assert first.host_duration_ns is not None and first.host_duration_ns > 0
        outcome = await session.wait(WaitRequest(started.cell_id, 5000))
        assert outcome == LiveCell(Result(started.cell_id, [InputText("b")]))
        assert isinstance(outcome.response, Result)
        assert outcome.response.host_duration_ns is not None
        assert outcome.response.host_duration_ns > 0
        assert outcome.response.result_buffered_for_ns == 0  # not tracked by our runtime
        await session.shutdown()


@pytest.mark.parametrize(
    ("client", "host", "detail"),
    [
        (WireRevision.PINNED, WireRevision.LATEST, "Object contains unknown field"),
        (WireRevision.LATEST, WireRevision.PINNED, "Object missing required field"),
    ],
)
async def test_mismatched_revisions_fail_at_the_first_runtime_response(
    client: WireRevision, host: WireRevision, detail: str
) -> None:
    async with ProcessOwnedCodeModeSessionProvider(
        _command(host), wire_revision=client
    ) as provider:
        session = await provider.create_session(RecordingDelegate())  # the handshake is shared
        started = await session.execute(ExecuteRequest("call-1", 'text("x")'))
        with pytest.raises(CodeModeError, match=detail):
            await started.initial_response()
        assert not session.is_alive()


@pytest.mark.parametrize(
    "command",
    [
        ["host", "--stdio", "--wire-revision", "newest"],
        # "auto" is a host's choice per client; a decoder has nothing to choose it from.
        ["wire", "validate", "--type", "ClientToHost", "--wire-revision", "auto"],
    ],
)
def test_cli_rejects_an_unknown_revision(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "codemode", *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--wire-revision" in done.stderr
