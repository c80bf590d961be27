"""A Code Mode gRPC client that uses nothing of ``codemode`` (issue #12, ``grpc.md`` §14.3).

Run by ``tests/host/test_grpc_independent_client.py`` in a child interpreter::

    python -I independent_grpc_client.py --generated DIR --target HOST:PORT SCENARIO

``DIR`` holds ``codex/code_mode/v1_pb2.py`` and ``v1_pb2_grpc.py`` that ``grpc_tools.protoc`` has
just generated from a copy of the proto; they are the only protocol code this client uses. It runs
one scenario against the host and prints what it observed as one JSON object on stdout; the test
makes the assertions. It imports no ``codemode`` module (checked before it reports), and running in
its own interpreter keeps its generated descriptors out of the project's descriptor pool.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc, as for the host

import argparse
import asyncio
import importlib
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # grpc.md §1
SERVICE = "codex.code_mode.v1.CodeModeHost"
READ_TIMEOUT = 10.0

Report = dict[str, Any]


class Client:
    """The generated modules, a channel to the host and the stub over it."""

    def __init__(self, generated: Path, target: str) -> None:
        sys.path.insert(0, str(generated))
        self.pb: Any = importlib.import_module("codex.code_mode.v1_pb2")
        self.pb_grpc: Any = importlib.import_module("codex.code_mode.v1_pb2_grpc")
        for module in (self.pb, self.pb_grpc):
            origin = module.__file__
            if origin is None or not Path(origin).resolve().is_relative_to(generated.resolve()):
                raise RuntimeError(f"{module.__name__} was not the freshly generated module")
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        self.target = target
        self.channel = aio.insecure_channel(target, options=options)
        self.stub: Any = self.pb_grpc.CodeModeHostStub(self.channel)
        self.echo = self.pb.ToolDefinition(
            name="echo",
            tool_name=self.pb.ToolName(name="echo"),
            description="Echoes its input.",
            kind=self.pb.TOOL_KIND_FUNCTION,
        )

    async def open(self) -> Lease:
        call = self.stub.OpenSession(self.pb.OpenSessionRequest())
        first = await read(call)
        if first.WhichOneof("event") != "opened":
            raise RuntimeError(f"the lease began with {first}")
        return Lease(call, first.opened.session_id)

    def execute(
        self,
        lease: Lease,
        source: str,
        *,
        execution_id: str,
        tools: tuple[Any, ...] = (),
        yield_time_ms: int | None = None,
    ) -> Any:
        request = self.pb.ExecuteRequest(
            session_id=lease.session_id,
            execution_id=execution_id,
            tool_call_id="call-1",
            source=source,
            enabled_tools=list(tools),
        )
        if yield_time_ms is not None:
            request.yield_time_ms = yield_time_ms
        return self.stub.Execute(request)

    def wait_request(self, session_id: str, cell_id: str, yield_time_ms: int = 10_000) -> Any:
        return self.pb.WaitRequest(
            session_id=session_id,
            cell_id=cell_id,
            wait_id=str(uuid.uuid4()),
            yield_time_ms=yield_time_ms,
        )

    async def close(self, lease: Lease) -> Report:
        """CloseSession, then how the lease ended."""
        close = await status(
            self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=lease.session_id))
        )
        return {"close_session": close, "lease_end": await lease.end()}


class Lease:
    """An open session: its lease stream and id."""

    def __init__(self, call: Any, session_id: str) -> None:
        self.call = call
        self.session_id = session_id

    async def until(self, kind: str) -> Any:
        while True:
            event = await read(self.call)
            if event.WhichOneof("event") == kind:
                return getattr(event, kind)

    async def end(self) -> Report:
        """Read the lease to its end: the events left, then the status."""
        kinds = []
        try:
            while True:
                event = await asyncio.wait_for(self.call.read(), READ_TIMEOUT)
                if event is aio.EOF:
                    break
                kinds.append(event.WhichOneof("event"))
        except aio.AioRpcError as error:
            return {"events": kinds, "code": error.code().name, "details": error.details()}
        code = await self.call.code()
        return {"events": kinds, "code": code.name, "details": await self.call.details()}


async def read(call: Any) -> Any:
    message = await asyncio.wait_for(call.read(), READ_TIMEOUT)
    if message is aio.EOF:
        raise RuntimeError("the stream ended early")
    return message


async def status(awaitable: Awaitable[Any]) -> Report:
    """``{"code": "OK"}`` or the status an rpc failed with."""
    try:
        await asyncio.wait_for(awaitable, READ_TIMEOUT)
    except aio.AioRpcError as error:
        return {"code": error.code().name, "details": error.details()}
    return {"code": "OK"}


def outcome_report(outcome: Any) -> Report:
    kind = outcome.WhichOneof("outcome")
    report: Report = {
        "kind": kind,
        "cell_id": outcome.cell_id,
        "texts": [item.text.text for item in outcome.content_items],
    }
    if kind == "completed":
        completed = outcome.completed
        report["error_text"] = completed.error_text if completed.HasField("error_text") else None
    return report


async def execute_outcome(call: Any) -> Report:
    """The Execute stream's last event, then its end."""
    event = await read(call)
    if event.WhichOneof("event") != "outcome":
        raise RuntimeError(f"expected the outcome, got {event}")
    report = outcome_report(event.outcome)
    report["then_eof"] = await asyncio.wait_for(call.read(), READ_TIMEOUT) is aio.EOF
    report["status"] = (await call.code()).name
    return report


async def started(call: Any) -> Any:
    event = await read(call)
    if event.WhichOneof("event") != "started":
        raise RuntimeError(f"expected ExecutionStarted, got {event}")
    return event.started


def wait_response_report(response: Any) -> Report:
    state = response.WhichOneof("state")
    return {"state": state, **outcome_report(getattr(response, state))}


# -- scenarios ---------------------------------------------------------------------------------------


async def tool_calls(client: Client) -> Report:
    """Two ``echo`` calls: sequenced on the subscription, completed, the cell closes."""
    pb, stub = client.pb, client.stub
    lease = await client.open()
    subscription = stub.SubscribeToToolCalls(
        pb.SubscribeToToolCallsRequest(session_id=lease.session_id)
    )
    execution_id = str(uuid.uuid4())
    call = client.execute(
        lease,
        "const a = await tools.echo({value: 1}); const b = await tools.echo({value: 2});"
        "text(JSON.stringify([a, b]));",
        execution_id=execution_id,
        tools=(client.echo,),
    )
    start = await started(call)
    calls = []
    for index in (1, 2):
        tool_call = await read(subscription)
        calls.append(
            {
                "session_id": tool_call.session_id,
                "execution_id": tool_call.execution_id,
                "cell_id": tool_call.cell_id,
                "invocation_id": tool_call.invocation_id,
                "runtime_tool_call_id": tool_call.runtime_tool_call_id,
                "tool_name": tool_call.tool_name.name,
                "has_namespace": tool_call.tool_name.HasField("namespace"),
                "tool_kind": pb.ToolKind.Name(tool_call.tool_kind),
                "input": json.loads(tool_call.input_json),
                "sequence": tool_call.sequence,
            }
        )
        completion = await status(
            stub.CompleteToolCall(
                pb.CompleteToolCallRequest(
                    session_id=lease.session_id,
                    invocation_id=tool_call.invocation_id,
                    succeeded=pb.ToolCallSucceeded(
                        output_json=json.dumps({"echo": index}).encode()
                    ),
                )
            )
        )
        calls[-1]["completion"] = completion
    outcome = await execute_outcome(call)
    closed = await lease.until("cell_closed")
    report: Report = {
        "session_id": lease.session_id,
        "execution_id": execution_id,
        "started": {"execution_id": start.execution_id, "cell_id": start.cell_id},
        "tool_calls": calls,
        "outcome": outcome,
        "cell_closed": {
            "execution_id": closed.execution_id,
            "cell_id": closed.cell_id,
            "final_tool_call_sequence": closed.final_tool_call_sequence,
        },
    }
    report.update(await client.close(lease))
    subscription.cancel()
    return report


async def notifications(client: Client) -> Report:
    """``notify`` then acknowledge; a pending notification is cancelled by ``Terminate``."""
    pb, stub = client.pb, client.stub
    lease = await client.open()
    execution_id = str(uuid.uuid4())
    call = client.execute(lease, "notify('notice'); text('done')", execution_id=execution_id)
    start = await started(call)
    notification = await lease.until("notification")
    pending = asyncio.ensure_future(call.read())
    await asyncio.sleep(0.3)
    done_before_ack = pending.done()
    ack = pb.AcknowledgeNotificationRequest(
        session_id=lease.session_id, notification_id=notification.notification_id
    )
    acknowledged = await status(stub.AcknowledgeNotification(ack))
    event = await asyncio.wait_for(pending, READ_TIMEOUT)
    outcome = outcome_report(event.outcome)
    acknowledged_again = await status(stub.AcknowledgeNotification(ack))

    second_id = str(uuid.uuid4())
    second = client.execute(
        lease,
        "notify('pending'); await new Promise(() => {})",
        execution_id=second_id,
        yield_time_ms=60_000,
    )
    second_start = await started(second)
    pending_notification = await lease.until("notification")
    terminated = await asyncio.wait_for(
        stub.Terminate(
            pb.TerminateRequest(session_id=lease.session_id, cell_id=second_start.cell_id)
        ),
        READ_TIMEOUT,
    )
    cancelled = await lease.until("notification_cancelled")
    report: Report = {
        "execution_id": execution_id,
        "started": {"execution_id": start.execution_id, "cell_id": start.cell_id},
        "notification": {
            "execution_id": notification.execution_id,
            "cell_id": notification.cell_id,
            "call_id": notification.call_id,
            "text": notification.text,
            "notification_id": notification.notification_id,
        },
        "outcome_before_ack": done_before_ack,
        "acknowledge": acknowledged,
        "outcome": outcome,
        "acknowledge_again": acknowledged_again,
        "pending": {
            "execution_id": second_id,
            "cell_id": second_start.cell_id,
            "notification_text": pending_notification.text,
            "notification_id": pending_notification.notification_id,
            "terminate": wait_response_report(terminated),
            "cancelled_notification_id": cancelled.notification_id,
            "execute_outcome": await execute_outcome(second),
        },
    }
    report.update(await client.close(lease))
    return report


async def observations(client: Client) -> Report:
    """Wait on a missing cell and an unknown session; CloseSession during a Wait; a dropped lease."""
    stub = client.stub
    lease = await client.open()
    missing = await asyncio.wait_for(stub.Wait(client.wait_request(lease.session_id, "42")), 10)
    unknown_session = str(uuid.uuid4())
    unknown = await status(stub.Wait(client.wait_request(unknown_session, "1")))

    # A pending cell whose first observation yields, then a long Wait that CloseSession ends.
    call = client.execute(
        lease, "await new Promise(() => {})", execution_id=str(uuid.uuid4()), yield_time_ms=100
    )
    start = await started(call)
    first = await execute_outcome(call)
    waiting = asyncio.ensure_future(
        status(stub.Wait(client.wait_request(lease.session_id, start.cell_id, 60_000)))
    )
    await asyncio.sleep(0.3)
    wait_pending_before_close = not waiting.done()
    closing_at = time.monotonic()
    closed = await client.close(lease)
    lease_ended_after = time.monotonic() - closing_at
    after_close = await status(stub.Wait(client.wait_request(lease.session_id, start.cell_id)))

    # Dropping the lease: the session is soon unknown.
    dropped = await client.open()
    dropped.call.cancel()
    dropped_at = time.monotonic()
    probe_codes: list[str] = []  # OK (missing cell) or CANCELLED (closing) until it is gone
    while True:
        probe = await status(stub.Wait(client.wait_request(dropped.session_id, "1")))
        if probe["code"] == "NOT_FOUND" or time.monotonic() - dropped_at > 5:
            break
        if probe["code"] not in probe_codes:
            probe_codes.append(probe["code"])
        await asyncio.sleep(0.02)
    return {
        "missing_cell": wait_response_report(missing),
        "unknown_session": unknown_session,
        "unknown_session_wait": unknown,
        "session_id": lease.session_id,
        "first_observation": first,
        "wait_pending_before_close": wait_pending_before_close,
        "wait_during_close": await waiting,
        **closed,
        "lease_ended_after_s": lease_ended_after,
        "wait_after_close": after_close,
        "dropped_session_id": dropped.session_id,
        "dropped_probe": probe,
        "dropped_probe_codes_before": probe_codes,
        "dropped_unknown_after_s": time.monotonic() - dropped_at,
    }


async def health(client: Client) -> Report:
    """``grpc.health.v1.Health/Check`` with grpcio-health-checking's own generated stubs."""
    from grpc_health.v1 import (  # type: ignore[import-untyped, unused-ignore]
        health_pb2,
        health_pb2_grpc,
    )

    checker = health_pb2_grpc.HealthStub(client.channel)
    report: Report = {}
    for service in ("", SERVICE):
        response = await asyncio.wait_for(
            checker.Check(health_pb2.HealthCheckRequest(service=service)), READ_TIMEOUT
        )
        report[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return report


SCENARIOS: dict[str, Callable[[Client], Awaitable[Report]]] = {
    "tool_calls": tool_calls,
    "notifications": notifications,
    "observations": observations,
    "health": health,
}


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--generated", type=Path, required=True)
    parser.add_argument("--target", required=True, help="HOST:PORT of the host")
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    args = parser.parse_args(argv)
    client = Client(args.generated, args.target)
    try:
        report = await SCENARIOS[args.scenario](client)
    finally:
        await client.channel.close()
    ours = sorted(name for name in sys.modules if name.split(".")[0] == "codemode")
    report["codemode_modules_imported"] = ours
    report["generated_modules"] = [client.pb.__file__, client.pb_grpc.__file__]
    report["grpc_version"] = grpc.__version__
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main())
