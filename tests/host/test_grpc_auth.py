"""Authentication and TLS of the gRPC carrier (``grpc.md`` §1: shared with the WebSocket listener):
``authorization: Bearer`` metadata on every rpc (health stays open), TLS with a PEM identity, and
the ``codemode host --listen grpc://`` rules for tokens, ``--insecure`` and ``--tls-cert/--tls-key``."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc: see codemode.host.grpc

import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from codemode.client.grpc import GrpcCodeModeSessionProvider
from codemode.errors import CodeModeError
from codemode.grpc_stubs import v1_pb2_grpc
from codemode.host.grpc import UNAUTHENTICATED_MESSAGE, GrpcHost, GrpcTls
from codemode.protocol.grpc import v1_pb2 as pb
from codemode.protocol.types import (
    JSON,
    CodeModeNestedToolCall,
    ExecuteRequest,
    InputText,
    Result,
    ToolDefinition,
    ToolName,
)
from codemode.runtime import LocalSessionProvider
from codemode.session import CancellationToken, CodeModeSessionDelegate

TOKEN = "s3cret-token"
ECHO = ToolDefinition("echo", ToolName("echo"), "echo")


class Echo(CodeModeSessionDelegate):
    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        return {"echo": invocation.input}


async def _run_cell(client: GrpcCodeModeSessionProvider) -> None:
    """A cell with a nested tool call (lease, subscription, Execute and CompleteToolCall)."""
    session = await client.create_session(Echo())
    try:
        started = await session.execute(
            ExecuteRequest("call-1", "text(JSON.stringify(await tools.echo({v: 1})))", [ECHO])
        )
        response = await started.initial_response()
        assert response == Result(started.cell_id, [InputText('{"echo":{"v":1}}')])
    finally:
        await session.shutdown()


@pytest.fixture
async def guarded(provider: LocalSessionProvider) -> AsyncIterator[GrpcHost]:
    host = GrpcHost(provider, "grpc://127.0.0.1:0", token=TOKEN)
    await host.start()
    try:
        yield host
    finally:
        await host.aclose()


def _stub(host: GrpcHost) -> tuple[aio.Channel, Any]:
    channel = aio.insecure_channel(host.url.removeprefix("grpc://"))
    return channel, v1_pb2_grpc.CodeModeHostStub(channel)


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize("metadata", [None, _bearer("wrong"), (("authorization", TOKEN),)])
async def test_open_session_needs_the_token(guarded: GrpcHost, metadata: Any) -> None:
    channel, stub = _stub(guarded)
    async with channel:
        call = stub.OpenSession(pb.OpenSessionRequest(), metadata=metadata)
        with pytest.raises(aio.AioRpcError) as caught:
            await call.read()
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details() == UNAUTHENTICATED_MESSAGE
    assert guarded.sessions == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("scheme", ["bearer", "BEARER"])
async def test_the_scheme_is_taken_in_any_case(guarded: GrpcHost, scheme: str) -> None:
    # RFC 9110 §11.1: the authentication scheme is case-insensitive; the token is exact.
    channel, stub = _stub(guarded)
    async with channel:
        lease = stub.OpenSession(
            pb.OpenSessionRequest(), metadata=(("authorization", f"{scheme} {TOKEN}"),)
        )
        first = await lease.read()
        assert first.WhichOneof("event") == "opened"
        lease.cancel()
        wrong = stub.OpenSession(
            pb.OpenSessionRequest(), metadata=(("authorization", f"{scheme} {TOKEN.upper()}"),)
        )
        with pytest.raises(aio.AioRpcError) as caught:
            await wrong.read()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_execute_needs_the_token_even_in_an_open_session(guarded: GrpcHost) -> None:
    channel, stub = _stub(guarded)
    async with channel:
        lease = stub.OpenSession(pb.OpenSessionRequest(), metadata=_bearer(TOKEN))
        first = await lease.read()
        assert first.WhichOneof("event") == "opened"
        request = pb.ExecuteRequest(
            session_id=first.opened.session_id,
            execution_id=str(uuid.uuid4()),
            tool_call_id="call-1",
            source="text(1)",
        )
        for metadata in (None, _bearer("wrong")):
            with pytest.raises(aio.AioRpcError) as caught:
                await stub.Execute(request, metadata=metadata).read()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A unary rpc is guarded too.
        with pytest.raises(aio.AioRpcError) as caught:
            await stub.CloseSession(pb.CloseSessionRequest(session_id=first.opened.session_id))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert guarded.active_cells == 0
        lease.cancel()


async def test_health_stays_open(guarded: GrpcHost) -> None:
    from grpc_health.v1 import (  # type: ignore[import-untyped, unused-ignore]
        health_pb2,
        health_pb2_grpc,
    )

    async with aio.insecure_channel(guarded.url.removeprefix("grpc://")) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_cell_runs_with_the_token(guarded: GrpcHost) -> None:
    async with GrpcCodeModeSessionProvider(guarded.url, token=TOKEN) as client:
        await _run_cell(client)


async def test_the_client_without_the_token_is_refused(guarded: GrpcHost) -> None:
    async with GrpcCodeModeSessionProvider(guarded.url, token="wrong") as client:
        with pytest.raises(CodeModeError, match=r"UNAUTHENTICATED|bearer token"):
            await client.create_session(Echo())


async def test_a_token_without_a_token_host_is_harmless(provider: LocalSessionProvider) -> None:
    host = GrpcHost(provider, "grpc://127.0.0.1:0")
    await host.start()
    try:
        async with GrpcCodeModeSessionProvider(host.url, token=TOKEN) as client:
            await _run_cell(client)
    finally:
        await host.aclose()


# -- TLS -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def identity(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost (``cryptography`` is not a dependency
    of the venv: the ``openssl`` command line makes it)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("neither the cryptography package nor the openssl command is available")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


async def test_a_cell_runs_over_tls_and_plaintext_fails(
    provider: LocalSessionProvider, identity: tuple[Path, Path]
) -> None:
    cert, key = identity
    host = GrpcHost(provider, "grpc://127.0.0.1:0", token=TOKEN, tls=GrpcTls.from_files(cert, key))
    url = await host.start()
    assert url.startswith("grpc://127.0.0.1:")
    try:
        async with GrpcCodeModeSessionProvider(
            url, token=TOKEN, root_certificates=cert.read_bytes()
        ) as client:
            await _run_cell(client)
        async with GrpcCodeModeSessionProvider(url, token=TOKEN, open_timeout=5) as plaintext:
            with pytest.raises(CodeModeError):
                await plaintext.create_session(Echo())
        assert host.sessions == 0
    finally:
        await host.aclose()


def test_empty_tls_files_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        GrpcTls.from_files(empty, empty)


# -- the command line ----------------------------------------------------------------------------


def _environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != "CODEMODE_HOST_TOKEN"}


def _codemode(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "codemode", "host", *args],
        capture_output=True,
        timeout=60,
        check=False,
        env=_environment(),
    )


def test_cli_refuses_a_public_grpc_address_without_a_token() -> None:
    done = _codemode("--listen", "grpc://0.0.0.0:0")
    assert done.returncode == 2
    assert b"refusing to listen on 0.0.0.0 over gRPC without a token" in done.stderr
    assert b"--token-file" in done.stderr and b"--insecure" in done.stderr


def test_cli_tls_flags_go_together_and_only_with_grpc(identity: tuple[Path, Path]) -> None:
    cert, key = identity
    alone = _codemode("--listen", "grpc://127.0.0.1:0", "--tls-cert", str(cert))
    assert alone.returncode == 2
    assert b"--tls-cert and --tls-key go together" in alone.stderr
    websocket = _codemode(
        "--listen", "ws://127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key)
    )
    assert websocket.returncode == 2
    assert b"not supported yet" in websocket.stderr
    missing = _codemode(
        "--listen", "grpc://127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", "/nonexistent"
    )
    assert missing.returncode == 2
    assert b"--tls-cert/--tls-key" in missing.stderr


def test_cli_serves_a_public_grpc_address_with_a_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    command = [
        sys.executable,
        "-m",
        "codemode",
        "host",
        "--listen",
        "grpc://0.0.0.0:0",
        "--token-file",
        str(token_file),
    ]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_environment()
    ) as child:
        assert child.stdout is not None and child.stderr is not None
        try:
            url = child.stdout.readline().decode().strip()
            match = re.fullmatch(r"grpc://0\.0\.0\.0:(\d+)", url)
            assert match, url
            with grpc.insecure_channel(f"127.0.0.1:{match[1]}") as channel:
                stub = v1_pb2_grpc.CodeModeHostStub(channel)
                refused = stub.OpenSession(pb.OpenSessionRequest(), timeout=10)
                with pytest.raises(grpc.RpcError) as caught:
                    next(iter(refused))
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                lease = stub.OpenSession(
                    pb.OpenSessionRequest(), metadata=_bearer(TOKEN), timeout=30
                )
                first = next(iter(lease))
                assert first.WhichOneof("event") == "opened"
                lease.cancel()
        finally:
            child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=30) == 0
        assert b"auth=token" in child.stderr.read()
