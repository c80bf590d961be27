"""A client generated independently from the proto interoperates with the host (issue #12).

At test time the committed ``codex/code_mode/v1.proto`` (package data of
:mod:`codemode.protocol.grpc`, the spec's interface copied verbatim) is copied into a temporary
directory and compiled there with ``grpc_tools.protoc``. A child interpreter
(``independent_grpc_client.py``) imports only those fresh ``_pb2``/``_pb2_grpc`` modules — nothing
of ``codemode``, and in its own process so its descriptors never meet the project's in protobuf's
global pool — and runs the ``grpc.md`` §14.3 host cases against a real :class:`GrpcHost` over the
embedded runtime. It reports what it saw as JSON; the assertions are here, with the spec's texts.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc: see codemode.host.grpc

import asyncio
import json
import subprocess
import sys
import uuid
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from codemode.host.grpc import GrpcHost

CLIENT = Path(__file__).with_name("independent_grpc_client.py")
PROTO = "codex/code_mode/v1.proto"
SERVICE = "codex.code_mode.v1.CodeModeHost"
CLIENT_TIMEOUT = 15.0


def _child_environment() -> dict[str, str]:
    return {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh ``protoc`` build of a copy of the committed proto; the directory to import from."""
    root = tmp_path_factory.mktemp("independent-grpc-client")
    includes = root / "proto"
    proto = includes / PROTO
    proto.parent.mkdir(parents=True)
    proto.write_bytes(resources.files("codemode.protocol.grpc").joinpath(PROTO).read_bytes())
    out = root / "generated"
    out.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={includes}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            PROTO,
        ],
        cwd=includes,
        env=_child_environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("v1_pb2.py", "v1_pb2_grpc.py"):
        assert (out / "codex" / "code_mode" / name).is_file(), name
    return out


async def _run(generated: Path, host: GrpcHost, scenario: str) -> dict[str, Any]:
    """Run one scenario of the independent client against ``host``; its report."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",  # no PYTHONPATH, no script directory: only the venv and the generated modules
        str(CLIENT),
        "--generated",
        str(generated),
        "--target",
        host.url.removeprefix("grpc://"),
        scenario,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_child_environment(),
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), CLIENT_TIMEOUT)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, stderr.decode()
    report: dict[str, Any] = json.loads(stdout)
    assert report.pop("codemode_modules_imported") == []
    modules = report.pop("generated_modules")
    assert all(Path(module).is_relative_to(generated) for module in modules), modules
    report.pop("grpc_version")
    return report


def _closed_in_order(report: dict[str, Any]) -> None:
    assert report["close_session"] == {"code": "OK"}
    assert report["lease_end"]["code"] == "OK"


def _is_uuid4(value: str) -> bool:
    return uuid.UUID(value).version == 4


@pytest.mark.timeout(20)
async def test_nested_tool_calls_through_the_generated_stubs(
    generated: Path, grpc_host: GrpcHost
) -> None:
    report = await _run(generated, grpc_host, "tool_calls")
    assert _is_uuid4(report["session_id"])
    execution_id = report["execution_id"]
    started = report["started"]
    assert started["execution_id"] == execution_id
    cell_id = started["cell_id"]
    assert cell_id
    calls = report["tool_calls"]
    assert [call["sequence"] for call in calls] == [1, 2]
    for index, call in enumerate(calls, start=1):
        assert call["session_id"] == report["session_id"]
        assert call["execution_id"] == execution_id
        assert call["cell_id"] == cell_id
        assert _is_uuid4(call["invocation_id"])
        assert call["runtime_tool_call_id"] == f"tool-{index}"
        assert (call["tool_name"], call["has_namespace"]) == ("echo", False)
        assert call["tool_kind"] == "TOOL_KIND_FUNCTION"
        assert call["input"] == {"value": index}
        assert call["completion"] == {"code": "OK"}
    outcome = report["outcome"]
    assert outcome["kind"] == "completed"
    assert outcome["error_text"] is None
    assert outcome["cell_id"] == cell_id
    assert [json.loads(text) for text in outcome["texts"]] == [[{"echo": 1}, {"echo": 2}]]
    assert (outcome["then_eof"], outcome["status"]) == (True, "OK")
    assert report["cell_closed"] == {
        "execution_id": execution_id,
        "cell_id": cell_id,
        "final_tool_call_sequence": 2,
    }
    _closed_in_order(report)
    assert grpc_host.sessions == 0


@pytest.mark.timeout(20)
async def test_notifications_through_the_generated_stubs(
    generated: Path, grpc_host: GrpcHost
) -> None:
    report = await _run(generated, grpc_host, "notifications")
    notification = report["notification"]
    assert _is_uuid4(notification["notification_id"])
    assert notification == {
        "execution_id": report["execution_id"],
        "cell_id": report["started"]["cell_id"],
        "call_id": "call-1",
        "text": "notice",
        "notification_id": notification["notification_id"],
    }
    # The outcome arrives only after the acknowledgement.
    assert report["outcome_before_ack"] is False
    assert report["acknowledge"] == {"code": "OK"}
    assert report["outcome"]["kind"] == "completed"
    assert report["outcome"]["texts"] == ["done"]
    # A second acknowledgement is answered OK, as upstream 0.171.0 answers it.
    assert report["acknowledge_again"] == {"code": "OK"}
    # notify('pending') on a cell that never ends, then Terminate.
    pending = report["pending"]
    assert pending["notification_text"] == "pending"
    assert pending["terminate"]["state"] == "live_cell"
    assert pending["terminate"]["kind"] == "terminated"
    assert pending["cancelled_notification_id"] == pending["notification_id"]
    assert pending["execute_outcome"]["kind"] == "terminated"
    assert pending["execute_outcome"]["cell_id"] == pending["cell_id"]
    _closed_in_order(report)
    assert grpc_host.sessions == 0


@pytest.mark.timeout(20)
async def test_waits_and_session_end_through_the_generated_stubs(
    generated: Path, grpc_host: GrpcHost
) -> None:
    report = await _run(generated, grpc_host, "observations")
    assert report["missing_cell"] == {
        "state": "missing_cell",
        "kind": "completed",
        "cell_id": "42",
        "texts": [],
        "error_text": "exec cell 42 not found",
    }
    assert report["unknown_session_wait"] == {
        "code": "NOT_FOUND",
        "details": f"unknown code-mode session {report['unknown_session']}",
    }
    assert report["first_observation"]["kind"] == "yielded"
    # CloseSession during a 60 s Wait: the wait fails CANCELLED, the lease ends OK within 1 s.
    assert report["wait_pending_before_close"] is True
    assert report["wait_during_close"] == {
        "code": "CANCELLED",
        "details": "code-mode wait was cancelled",  # upstream 0.171.0's text
    }
    _closed_in_order(report)
    assert report["lease_end"]["events"] in ([], ["cell_closed"])
    assert report["lease_ended_after_s"] < 1.0
    assert report["wait_after_close"] == {
        "code": "NOT_FOUND",
        "details": f"unknown code-mode session {report['session_id']}",
    }
    # Dropping the lease stream: within 1 s the session is unknown.
    assert report["dropped_probe"] == {
        "code": "NOT_FOUND",
        "details": f"unknown code-mode session {report['dropped_session_id']}",
    }
    assert report["dropped_unknown_after_s"] < 1.0
    # Before that the session may still be seen, or seen closing (grpc.md §4.1).
    assert set(report["dropped_probe_codes_before"]) <= {"OK", "CANCELLED"}
    assert grpc_host.sessions == 0


@pytest.mark.timeout(20)
async def test_health_through_grpcio_health_checking(generated: Path, grpc_host: GrpcHost) -> None:
    report = await _run(generated, grpc_host, "health")
    assert report == {"": "SERVING", SERVICE: "SERVING"}
