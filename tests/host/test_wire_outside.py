"""Our stdio hosts checked from outside, with raw bytes, as an external checker would
(``protocol-v1.md`` §2.1, §2.5, §3.3, §6, §7.1, §8): each test starts ``codemode host --stdio``
(or ``codex-code-mode-host``) in a process group of its own, writes frames (valid or not) to its
stdin, and checks the exact frames on its stdout, its log line on stderr, its exit status, and
that no process of its group (its engines) outlives it. What upstream does in the same cases was
compared by hand on 0.149.0 and 0.171.0 (``docs/interop.md``); the frame-for-frame comparisons
that need the upstream binary are rows of ``test_upstream_wire_fidelity.py``.

``test_stdio_fuzz.py`` covers random garbage (that the host closes without writing more); this file
pins the exact texts, the bounds themselves, and what happens around the connection's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest

from codemode.protocol.constants import MAX_FRAME_BYTES, SHUTDOWN_TIMEOUT
from codemode.protocol.v1.messages import (
    DelegateRequestMessage,
    ExecuteInitialResponse,
    OperationRequest,
    SessionWait,
    WireWaitRequest,
)
from tests.host import raw
from tests.host.raw import ECHO, HELLO, READY, compact, request
from tests.host.test_websocket import ECHO as WS_ECHO
from tests.host.test_websocket import child_host, open_single
from tests.host.test_websocket import execute as ws_execute
from tests.host.test_websocket import open_session as ws_open_session
from tests.wire import FrameReader, frame

HOST: Final = [sys.executable, "-m", "codemode", "host", "--stdio"]
CODEX_HOST: Final = [
    sys.executable,
    "-c",
    "import sys; from codemode.cli.codex_host import main; sys.exit(main())",
]
READ: Final = 15.0  # one frame, the engine warming up meanwhile
EXIT: Final = SHUTDOWN_TIMEOUT + 3.0

L1: Final = "failed to read code-mode client hello: "
L2: Final = "failed to read code-mode client message: "
DECODE: Final = "failed to decode code-mode IPC frame: "


def open_session(request_id: int, session: str = "s1") -> dict[str, Any]:
    return request(request_id, {"method": "session/open", "sessionId": session})


def shutdown(request_id: int, session: str = "s1") -> dict[str, Any]:
    return request(request_id, {"method": "session/shutdown", "sessionId": session})


def execute(
    request_id: int, source: str, yield_ms: int = 5000, session: str = "s1", **fields: Any
) -> dict[str, Any]:
    return raw.execute(request_id, source, yield_ms, session, **fields)


def wait(request_id: int, cell: str, session: str = "s1") -> dict[str, Any]:
    body = {"cell_id": cell, "yield_time_ms": 0}
    return request(request_id, {"method": "session/wait", "sessionId": session, "request": body})


def ready(request_id: int, session: str = "s1") -> bytes:
    value = {"type": "session/ready", "sessionId": session}
    return compact({"type": "operation/response", "id": request_id, "result": ok(value)})


def closed(request_id: int, session: str = "s1") -> bytes:
    value = {"type": "session/closed", "sessionId": session}
    return compact({"type": "operation/response", "id": request_id, "result": ok(value)})


def ok(value: Any) -> dict[str, Any]:
    return {"status": "ok", "value": value}


def frames(*messages: dict[str, Any] | bytes) -> bytes:
    return b"".join(frame(m if isinstance(m, bytes) else compact(m)) for m in messages)


@dataclass
class Host:
    process: asyncio.subprocess.Process
    stdout: FrameReader
    stderr: list[str] = field(default_factory=list)
    collector: asyncio.Task[None] | None = None

    def write(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data)

    async def payload(self) -> bytes:
        payload = await self.stdout.payload(READ)
        assert payload is not None
        return payload

    async def payloads(self, count: int) -> list[bytes]:
        return [await self.payload() for _ in range(count)]

    async def exit_status(self) -> int:
        async with asyncio.timeout(EXIT):
            return await self.process.wait()

    async def log(self) -> str:
        if self.collector is not None:
            async with asyncio.timeout(EXIT):
                await self.collector
        return "\n".join(self.stderr)

    async def gone(self) -> bool:
        """True once no process of the host's group (the host, its engines) is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3.0
        while loop.time() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return True
            await asyncio.sleep(0.02)
        return False

    def group(self) -> list[int]:
        """The processes of the host's group (the host and its engines)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                if int(fields[2]) == self.process.pid and fields[0] != "Z":
                    found.append(int(entry))
        return found


@contextlib.asynccontextmanager
async def host(command: list[str] = HOST) -> AsyncIterator[Host]:
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stdout is not None and process.stderr is not None
    served = Host(process, FrameReader(process.stdout))
    stderr = process.stderr

    async def collect() -> None:
        while line := await stderr.readline():
            served.stderr.append(line.decode("utf-8", "replace").rstrip("\n"))

    served.collector = asyncio.ensure_future(collect())
    try:
        yield served
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        if process.stdin is not None and not process.stdin.transport.is_closing():
            process.stdin.transport.abort()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(process.stdout.read(), 10)
        await asyncio.wait_for(process.wait(), 10)
        served.collector.cancel()
        with contextlib.suppress(BaseException):
            await served.collector


# -- malformed input: the exact log line, nothing written, non-zero -------------------------------


@dataclass(frozen=True)
class Bad:
    stage: str  # "first" (instead of the hello) or "open" (after the hello and an open)
    data: bytes
    log: str  # the whole L line's text; for a decode error, its start
    eof: bool = False  # the host only knows at the end of stream


OPEN_TOO: Final = b'{"type":"operation/request","id":2,"request":{"method":"session/open",'
BAD: Final = {
    "zero-length first frame": Bad("first", frame(b""), L1 + DECODE),
    "oversize prefix, refused before any payload": Bad(
        "first",
        (MAX_FRAME_BYTES + 1).to_bytes(4, "little"),
        L1 + f"code-mode IPC frame length {MAX_FRAME_BYTES + 1} exceeds 67108864 bytes",
    ),
    "largest prefix after the hello": Bad(
        "open",
        b"\xff\xff\xff\xff",
        L2 + "code-mode IPC frame length 4294967295 exceeds 67108864 bytes",
    ),
    "zero-length frame": Bad("open", frame(b""), L2 + DECODE),
    "prefix cut off by EOF": Bad(
        "open", b"\x05\x00", L2 + "code-mode IPC frame length prefix truncated after 2 bytes", True
    ),
    "payload cut off by EOF": Bad(
        "open",
        (20).to_bytes(4, "little") + b'{"type"',
        L2 + "code-mode IPC frame payload truncated: declared 20 bytes, received 7",
        True,
    ),
    "invalid UTF-8": Bad(
        "open", frame(b'{"type":"operation/cancel","id":1,"x":"\xff"}'), L2 + DECODE
    ),
    "a JSON array": Bad("open", frame(b"[]"), L2 + DECODE),
    "a JSON number first": Bad("first", frame(b"1"), L1 + DECODE),
    "a JSON string": Bad("open", frame(b'"hi"'), L2 + DECODE),
    "JSON null": Bad("open", frame(b"null"), L2 + DECODE),
    "duplicate key": Bad(
        "open", frame(OPEN_TOO + b'"sessionId":"a","sessionId":"b"}}'), L2 + DECODE
    ),
    "unknown field in a nested object": Bad(
        "open", frame(OPEN_TOO + b'"sessionId":"a","x":1}}'), L2 + DECODE
    ),
    "a number as the session id": Bad("open", frame(OPEN_TOO + b'"sessionId":1}}'), L2 + DECODE),
    "a blank session id": Bad(
        "open", frame(OPEN_TOO + b'"sessionId":" "}}'), L2 + DECODE + "identifier must not be empty"
    ),
    "request id 2^63": Bad(
        "open", frame(b'{"type":"operation/cancel","id":9223372036854775808}'), L2 + DECODE
    ),
    "request id 1.0": Bad("open", frame(b'{"type":"operation/cancel","id":1.0}'), L2 + DECODE),
    "yield_time_ms 2^64": Bad("open", frame(compact(execute(2, "1", 2**64))), L2 + DECODE),
    "max_output_tokens 2^31": Bad(
        "open", frame(compact(execute(2, "1", max_output_tokens=2**31))), L2 + DECODE
    ),
    "protocol version 0": Bad(
        "first", frame(compact({**HELLO, "supportedVersions": [0, 1]})), L1 + DECODE
    ),
    "protocol version 2^32": Bad(
        "first", frame(compact({**HELLO, "supportedVersions": [1, 2**32]})), L1 + DECODE
    ),
    "a second hello": Bad(
        "open", frame(compact(HELLO)), "received a second code-mode client hello"
    ),
    "a finished request id again": Bad(
        "open", frame(compact(open_session(1, "s2"))), "duplicate code-mode request ID 1"
    ),
    "a response to a delegate id never issued": Bad(
        "open",
        frame(
            compact(
                {
                    "type": "delegate/response",
                    "id": 5,
                    "result": ok({"type": "notification/delivered"}),
                }
            )
        ),
        "code-mode client returned unknown delegate request ID 5",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
async def test_malformed_input_ends_the_connection_with_the_exact_text(case: str) -> None:
    bad = BAD[case]
    async with host() as served:
        if bad.stage == "open":
            served.write(frames(HELLO, open_session(1)))
            assert await served.payloads(2) == [READY, ready(1)]
        served.write(bad.data)
        if bad.eof:
            assert served.process.stdin is not None
            served.process.stdin.close()
        # Nothing more is written (a bad first frame: nothing at all), and stdout ends.
        assert await served.stdout.rest(EXIT) == b""
        assert await served.exit_status() == 1
        log = await served.log()
        wanted = f"codemode host: WARNING {bad.log}"
        if DECODE in bad.log:  # the rest of the detail is the decoder's
            assert any(line.startswith(wanted) for line in served.stderr), log
        else:  # the whole line
            assert wanted in served.stderr, log
        assert "Traceback" not in log, log
        assert await served.gone(), "a process of the host outlived it"


@pytest.mark.timeout(60)
async def test_a_request_before_the_hello_is_rejected_then_closed() -> None:
    async with host() as served:
        served.write(frames(open_session(1)))
        rejected = (
            b'{"type":"connection/rejected","reason":{"type":"invalidHello",'
            b'"message":"first message must be connection/hello"}}'
        )
        assert await served.payload() == rejected
        assert await served.stdout.rest(EXIT) == b""
        assert await served.exit_status() == 0  # as upstream: an answered hello is a clean end
        assert await served.gone()


# -- the bounds themselves -------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_a_frame_of_exactly_64_mib_is_read_and_the_stream_stays_aligned() -> None:
    cancel = b'{"type":"operation/cancel","id":5}'
    padded = cancel + b" " * (MAX_FRAME_BYTES - len(cancel))  # trailing whitespace is allowed
    async with host() as served:
        served.write(frames(HELLO, open_session(1)))
        assert await served.payloads(2) == [READY, ready(1)]
        served.write(frame(padded) + frames(wait(2, "9")))
        missing = {
            "MissingCell": {
                "Result": {
                    "cell_id": "9",
                    "content_items": [],
                    "error_text": "exec cell 9 not found",
                }
            }
        }
        answer = {"type": "wait/completed", "outcome": missing}
        assert await served.payload() == compact(
            {"type": "operation/response", "id": 2, "result": ok(answer)}
        )
        assert served.process.stdin is not None
        served.process.stdin.close()
        assert await served.stdout.rest(EXIT) == b""
        assert await served.exit_status() == 0
        assert await served.gone()


@pytest.mark.timeout(60)
async def test_request_ids_at_the_bounds_of_i64_are_answered() -> None:
    low, high = -(2**63), 2**63 - 1
    async with host() as served:
        served.write(frames(HELLO, open_session(low), open_session(high, "s2")))
        assert await served.payloads(3) == [READY, ready(low), ready(high, "s2")]


# -- answer order -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_shutdown_with_no_cell_is_answered_before_an_open_read_with_it() -> None:
    """As both upstream releases: ``session/closed`` does not wait for the engine to stop."""
    async with host() as served:
        served.write(frames(HELLO, open_session(1)))
        assert await served.payloads(2) == [READY, ready(1)]
        served.write(frames(shutdown(2), open_session(3, "s2"), open_session(4, "s3")))
        assert await served.payloads(3) == [closed(2), ready(3, "s2"), ready(4, "s3")]
        served.write(frames(open_session(5, "s4"), shutdown(6, "s4"), open_session(7, "s4")))
        reused = {"status": "error", "message": "code-mode session ID `s4` was reused"}
        assert await served.payloads(3) == [
            ready(5, "s4"),
            closed(6, "s4"),
            compact({"type": "operation/response", "id": 7, "result": reused}),
        ]
        assert served.process.stdin is not None
        served.process.stdin.close()
        assert await served.exit_status() == 0
        assert await served.gone(), "an engine outlived the host"


# -- the connection's end ----------------------------------------------------------------------------


async def busy_host(served: Host) -> None:
    """Two sessions with a spinning cell, a pending tool call and a pending notification."""
    served.write(
        frames(
            HELLO,
            open_session(1),
            open_session(2, "s2"),
            execute(3, "while (true) {}", yield_ms=0),
            execute(4, "await tools.echo({}); text('never')", 60_000, enabled_tools=[ECHO]),
            execute(5, "notify('n'); await new Promise(() => {})", 0, session="s2"),
        )
    )
    seen: set[str] = set()
    while not {"tool/invoke", "notification/send"} <= seen:
        message = json.loads(await served.payload())
        if message["type"] == "delegate/request":
            seen.add(message["request"]["type"])
    assert len(served.group()) >= 3, "expected the host and an engine per session"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "command", [HOST, CODEX_HOST], ids=["codemode-host", "codex-code-mode-host"]
)
async def test_a_client_that_disappears_leaves_no_process_behind(command: list[str]) -> None:
    async with host(command) as served:
        await busy_host(served)
        assert served.process.stdin is not None
        served.process.stdin.transport.abort()  # the client is gone: both pipes close
        stdout = served.process._transport.get_pipe_transport(1)  # type: ignore[attr-defined]
        stdout.close()
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert await served.exit_status() == 0  # stdin's end is a clean end (§7.1)
        assert loop.time() - began < SHUTDOWN_TIMEOUT
        assert await served.gone(), "an engine outlived the host"
        log = await served.log()
        assert "failed to deliver code mode notification: code-mode client connection closed" in (
            log
        )
        assert "Traceback" not in log, log


@pytest.mark.timeout(60)
async def test_a_write_the_client_does_not_take_any_more_ends_the_connection() -> None:
    """A client that closed its end of stdout: the next write fails, a connection error (§8.9);
    the host exits non-zero and stops its engines. (Upstream keeps running until stdin ends.)"""
    async with host() as served:
        await busy_host(served)
        stdout = served.process._transport.get_pipe_transport(1)  # type: ignore[attr-defined]
        stdout.close()
        await asyncio.sleep(0.2)
        served.write(frames(wait(6, "9")))
        assert await served.exit_status() == 1
        assert await served.gone(), "an engine outlived the host"
        log = await served.log()
        assert "WARNING failed to write code-mode client message: " in log, log


@pytest.mark.timeout(60)
async def test_answers_written_before_stdin_ended_reach_a_client_that_reads_late() -> None:
    """8 MiB of results were answered while the client did not read; it closes stdin, reads
    two seconds later, and gets every frame (the host used to exit and drop them)."""
    count = 8
    async with host() as served:
        sources = [execute(2 + i, 'text("x".repeat(1 << 20))') for i in range(count)]
        served.write(frames(HELLO, open_session(1), *sources))
        await asyncio.sleep(3.0)
        assert served.process.stdin is not None
        served.process.stdin.close()
        await asyncio.sleep(2.0)
        received = [await served.payload() for _ in range(2 + 3 * count)]
        assert await served.stdout.rest(EXIT) == b""
        assert await served.exit_status() == 0
        results = [json.loads(p) for p in received if p.startswith(b'{"type":"execute/initial')]
        assert len(results) == count
        for message in results:
            item = message["result"]["value"]["Result"]["content_items"][0]
            assert item == {"type": "input_text", "text": "x" * (1 << 20)}
        assert sum(p.startswith(b'{"type":"cell/closed"') for p in received) == count


@pytest.mark.timeout(60)
async def test_a_client_that_never_reads_cannot_keep_the_host_alive() -> None:
    """Its answers fill the pipe; once stdin ends the host gives them ``SHUTDOWN_TIMEOUT`` to
    leave, then exits non-zero, saying so (upstream blocks on the write for ever)."""
    async with host() as served:
        sources = [execute(2 + i, 'text("x".repeat(1 << 20))') for i in range(4)]
        served.write(frames(HELLO, open_session(1), *sources))
        await asyncio.sleep(3.0)
        assert served.process.stdin is not None
        served.process.stdin.close()
        loop = asyncio.get_running_loop()
        began = loop.time()
        # Not read: the process must end by itself (its exit is seen in /proc, not via wait(),
        # which also waits for the pipes).
        while served.group():
            assert loop.time() - began < EXIT, "the host kept running"
            await asyncio.sleep(0.05)
        assert loop.time() - began >= SHUTDOWN_TIMEOUT - 0.5
        await served.stdout.rest(EXIT)
        assert await served.exit_status() == 1
        log = await served.log()
        assert "were not written within 5 s" in log, log


# -- many sessions ------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_many_sessions_at_once_each_get_their_answers() -> None:
    count = 24
    async with host() as served:
        opens = [open_session(1 + i, f"s{i}") for i in range(count)]
        runs = [execute(100 + i, f"text({i})", session=f"s{i}") for i in range(count)]
        served.write(frames(HELLO, *opens, *runs))
        assert await served.payload() == READY
        received = [json.loads(await served.payload()) for _ in range(count * 4)]
        by_type: dict[str, list[dict[str, Any]]] = {}
        for message in received:
            by_type.setdefault(message["type"], []).append(message)
        responses = by_type["operation/response"]
        assert sorted(m["id"] for m in responses) == [
            *range(1, count + 1),
            *range(100, 100 + count),
        ]
        assert all(m["result"]["status"] == "ok" for m in responses)
        results = {
            m["id"]: m["result"]["value"]["Result"] for m in by_type["execute/initialResponse"]
        }
        assert {i: r["content_items"] for i, r in results.items()} == {
            100 + i: [{"type": "input_text", "text": str(i)}] for i in range(count)
        }
        assert len(by_type["cell/closed"]) == count
        served.write(frames(*(shutdown(200 + i, f"s{i}") for i in range(count))))
        closes = sorted(json.loads(payload)["id"] for payload in await served.payloads(count))
        assert closes == list(range(200, 200 + count))
        assert served.process.stdin is not None
        served.process.stdin.close()
        assert await served.stdout.rest(EXIT) == b""
        assert await served.exit_status() == 0
        assert await served.gone(), "an engine outlived the host"


# -- the WebSocket listener: many connections, then all of them gone -----------------------------


def group_pids(pgid: int) -> set[int]:
    """Live processes of process group ``pgid`` (the listener and its engines)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    found.add(int(entry))
    return found


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_many_websocket_connections_that_vanish_leave_only_the_listener() -> None:
    """Eight connections at once, each with a session whose cell waits on a tool call and one
    that spins; every socket is then reset (no close frame). The listener keeps serving, and
    every engine the sessions used stops (the pool's one warm engine may stay)."""
    async with child_host("--listen", "ws://127.0.0.1:0") as child:
        sockets = await asyncio.gather(*(open_single(child.url) for _ in range(8)))

        async def busy(index: int) -> None:
            control = sockets[index]
            await ws_open_session(control, 1, f"s{index}")
            await control.send(ws_execute(2, f"s{index}", "await tools.echo({})", (WS_ECHO,)))
            await control.send(ws_execute(3, f"s{index}", "while (true) {}", yield_ms=0))
            kinds = {type(await control.receive(timeout=20)).__name__ for _ in range(4)}
            assert DelegateRequestMessage.__name__ in kinds, kinds
            assert ExecuteInitialResponse.__name__ in kinds, kinds

        await asyncio.gather(*(busy(i) for i in range(8)))
        assert len(group_pids(child.pid)) >= 9, "expected an engine per session"
        for control in sockets:
            control.ws.abort()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_TIMEOUT + 3.0
        # What may stay: the listener and the pool's one warm engine (started afresh, or the
        # one taken before the sessions came, were it not used).
        while len(left := group_pids(child.pid) - {child.pid}) > 1:
            assert loop.time() < deadline, f"engines {sorted(left)} outlived their connections"
            await asyncio.sleep(0.05)
        # The listener still serves.
        fresh = await open_single(child.url)
        await ws_open_session(fresh, 1)
        await fresh.send(OperationRequest(2, SessionWait("session-1", WireWaitRequest("9", 0))))
        reply = await fresh.receive(timeout=20)
        assert getattr(reply, "id", None) == 2, reply
        await fresh.ws.close()
