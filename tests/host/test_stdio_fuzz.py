"""Fuzz the real ``codemode host --stdio`` process with malformed input (``protocol-v1.md`` §3.3,
§6.2, §8.4, §8.9).

Each example spawns a fresh host, optionally completes a handshake (and opens a session with a
running cell), then writes one piece of garbage. The host must answer as the specification says:
a bad first frame closes stdout without a byte written; a bad frame later writes nothing more. In
both cases it closes stdout and exits non-zero promptly, never hangs and never prints a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Final

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from codemode.protocol.constants import MAX_FRAME_BYTES
from tests.host.raw import HELLO, READY, compact
from tests.wire import FrameReader, frame

HOST_COMMAND: Final = [sys.executable, "-m", "codemode", "host", "--stdio"]
READ_TIMEOUT: Final = 10.0  # a generous bound for one frame (the engine warms up meanwhile)
EXIT_TIMEOUT: Final = 5.0  # cleanup after a connection error (SHUTDOWN_TIMEOUT)

OPEN: Final = {
    "type": "operation/request",
    "id": 1,
    "request": {"method": "session/open", "sessionId": "session-1"},
}
SESSION_READY: Final = (
    b'{"type":"operation/response","id":1,"result":{"status":"ok",'
    b'"value":{"type":"session/ready","sessionId":"session-1"}}}'
)
EXECUTE: Final = {
    "type": "operation/request",
    "id": 2,
    "request": {
        "method": "session/execute",
        "sessionId": "session-1",
        "request": {
            "tool_call_id": "call-1",
            "enabled_tools": [],
            # Its initial response would come 2 s later: it must never be written.
            "source": "await new Promise((r) => setTimeout(r, 2000)); text('late');",
            "yield_time_ms": 60000,
            "max_output_tokens": None,
        },
    },
}
SPIN: Final = {
    "type": "operation/request",
    "id": 3,
    "request": {
        "method": "session/execute",
        "sessionId": "session-1",
        "request": {
            "tool_call_id": "call-2",
            "enabled_tools": [],
            # Yields at once and keeps running: its cell/closed must never be written.
            "source": "while (true) {}",
            "yield_time_ms": 0,
            "max_output_tokens": None,
        },
    },
}
ADMITTED: Final = sorted(
    [
        b'{"type":"operation/response","id":2,"result":{"status":"ok",'
        b'"value":{"type":"execution/started","cellId":"1"}}}',
        b'{"type":"operation/response","id":3,"result":{"status":"ok",'
        b'"value":{"type":"execution/started","cellId":"2"}}}',
        b'{"type":"execute/initialResponse","id":3,"result":{"status":"ok",'
        b'"value":{"Yielded":{"cell_id":"2","content_items":[]}}}}',
    ]
)
# Valid messages that the mutations below break (the tag values every decoder accepts).
BASES: Final[list[dict[str, Any]]] = [
    HELLO,
    OPEN,
    EXECUTE,
    {"type": "operation/cancel", "id": 7},
    {
        "type": "delegate/response",
        "id": 1,
        "result": {"status": "ok", "value": {"type": "notification/delivered"}},
    },
]
KNOWN_TAGS: Final = {
    "connection/hello",
    "operation/request",
    "operation/cancel",
    "delegate/response",
}


# -- garbage ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Garbage:
    """Bytes to write; ``complete`` when the host can tell they are bad without an end of stream."""

    kind: str
    data: bytes
    complete: bool
    #: The host's log line (L1-L6) when it is not the reader error of the stage.
    log: str | None = None


def _with_unknown_field(base: dict[str, Any], key: str) -> bytes:
    return compact({**base, key: 1})


def _with_duplicate_key(base: dict[str, Any]) -> bytes:
    text = compact(base).decode()
    # Repeat the tag: {"type":"x","type":"x",...}
    tag = compact(base["type"]).decode()
    return text.replace(f'"type":{tag}', f'"type":{tag},"type":{tag}', 1).encode()


def _with_value(base: dict[str, Any], key: str, raw: str) -> bytes:
    text = compact({**base, key: "__placeholder__"}).decode()
    return text.replace('"__placeholder__"', raw, 1).encode()


@st.composite
def malformed_messages(draw: st.DrawFn) -> Garbage:
    """A complete frame whose payload is not a valid client message."""
    base = draw(st.sampled_from(BASES))
    mutation = draw(
        st.sampled_from(
            ["unknown-field", "wrong-tag", "duplicate-key", "nan", "wrong-type", "missing-field"]
        )
    )
    if mutation == "unknown-field":
        key = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in base))
        payload = _with_unknown_field(base, key)
    elif mutation == "wrong-tag":
        tag = draw(st.text(max_size=20).filter(lambda t: t not in KNOWN_TAGS))
        payload = compact({**base, "type": tag})
    elif mutation == "duplicate-key":
        payload = _with_duplicate_key(base)
    elif mutation == "nan":
        key = "id" if "id" in base else "supportedVersions"
        payload = _with_value(base, key, draw(st.sampled_from(["NaN", "Infinity", "-Infinity"])))
    elif mutation == "wrong-type":
        key = "id" if "id" in base else "supportedVersions"
        raw = draw(st.sampled_from(['"1"', "1.5", "true", "null", "{}", "1e3"]))
        payload = _with_value(base, key, raw)
    else:
        key = draw(st.sampled_from(sorted(k for k in base if k != "type")))
        payload = compact({k: v for k, v in base.items() if k != key})
    return Garbage(f"message/{mutation}", frame(payload), complete=True)


@st.composite
def invalid_json(draw: st.DrawFn) -> Garbage:
    """A complete frame whose payload is not strict JSON (or not UTF-8)."""
    payload = draw(
        st.one_of(
            st.sampled_from(
                [
                    b"",
                    b"{",
                    b"nul",
                    b'{"type":"operation/cancel","id":1}x',
                    b'\xef\xbb\xbf{"type":"operation/cancel","id":1}',
                    b'{"type":"operation/cancel","id":1e400}',
                    b'{"type":"operation/cancel","id":1,"s":"\\ud800"}',
                    b"\xff\xfe\xfd",
                ]
            ),
            st.binary(min_size=1, max_size=40).filter(lambda b: not b.strip().startswith(b"{")),
        )
    )
    return Garbage("invalid-json", frame(payload), complete=True)


@st.composite
def oversize_prefixes(draw: st.DrawFn) -> Garbage:
    """A length prefix above the limit, refused before any payload is read."""
    length = draw(st.integers(MAX_FRAME_BYTES + 1, 2**32 - 1))
    tail = draw(st.binary(max_size=16))
    return Garbage("oversize", length.to_bytes(4, "little") + tail, complete=True)


@st.composite
def truncated_frames(draw: st.DrawFn) -> Garbage:
    """A frame cut short (in its prefix or its payload), then the end of stream."""
    payload = compact(draw(st.sampled_from(BASES)))
    whole = frame(payload)
    cut = draw(st.integers(1, len(whole) - 1))
    return Garbage("truncated", whole[:cut], complete=False)


@st.composite
def random_bytes(draw: st.DrawFn) -> Garbage:
    """Anything at all, then the end of stream."""
    return Garbage("random", draw(st.binary(min_size=1, max_size=64)), complete=False)


GARBAGE: Final = st.one_of(
    malformed_messages(), invalid_json(), oversize_prefixes(), truncated_frames(), random_bytes()
)


# -- the host process -------------------------------------------------------------------------------


async def group_gone(pgid: int, timeout: float = 2.0) -> bool:
    """True once no process of the host's process group (the host, its engine) is left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.02)


async def scenario(stage: str, garbage: Garbage) -> None:
    process = await asyncio.create_subprocess_exec(
        *HOST_COMMAND,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stdin is not None and process.stdout is not None
    assert process.stderr is not None
    stderr_task = asyncio.ensure_future(process.stderr.read())
    try:
        stdin, stdout = process.stdin, FrameReader(process.stdout)
        if stage != "first":
            stdin.write(frame(compact(HELLO)))
            assert await stdout.payload(READ_TIMEOUT) == READY
        if stage == "cell":
            stdin.write(frame(compact(OPEN)) + frame(compact(EXECUTE)) + frame(compact(SPIN)))
            assert await stdout.payload(READ_TIMEOUT) == SESSION_READY
            assert sorted([await stdout.payload(READ_TIMEOUT) for _ in ADMITTED]) == ADMITTED
        stdin.write(garbage.data)
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(READ_TIMEOUT):
                await stdin.drain()
        if not garbage.complete:
            stdin.close()  # the host only knows the frame is cut short at the end of stream
        # Nothing more is written; stdout is closed promptly.
        rest = await stdout.rest(EXIT_TIMEOUT)
        assert rest == b"", f"the host wrote {rest!r} after {garbage.kind}"
        async with asyncio.timeout(EXIT_TIMEOUT):
            status = await process.wait()
        async with asyncio.timeout(EXIT_TIMEOUT):
            errors = (await stderr_task).decode(errors="replace")
        assert status != 0, errors
        assert "Traceback" not in errors, errors
        if garbage.log is not None:
            expected = garbage.log
        elif stage == "first":
            expected = "failed to read code-mode client hello: "
        else:
            expected = "failed to read code-mode client message: "
        assert expected in errors, errors
        assert await group_gone(process.pid), "the host left a process behind"
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # anything the host left in its group
        if process.stdin is not None:
            process.stdin.close()
        stderr_task.cancel()
        with contextlib.suppress(BaseException):
            await stderr_task


@pytest.mark.timeout(150)
@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    # No shrinking: a hung host costs EXIT_TIMEOUT per example, and the examples are small.
    phases=[Phase.explicit, Phase.generate],
)
@given(stage=st.sampled_from(["first", "hello", "cell"]), garbage=GARBAGE)
def test_the_host_survives_garbage(stage: str, garbage: Garbage) -> None:
    asyncio.run(scenario(stage, garbage))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("stage", "garbage"),
    [
        ("first", Garbage("oversize", b"\xff\xff\xff\xff", complete=True)),
        ("hello", Garbage("oversize", (MAX_FRAME_BYTES + 1).to_bytes(4, "little"), True)),
        (
            "cell",
            Garbage(
                "second-hello",
                frame(compact(HELLO)),
                complete=True,
                log="received a second code-mode client hello",
            ),
        ),
        (
            "cell",
            Garbage(
                "duplicate-id",
                frame(compact(EXECUTE)),
                complete=True,
                log="duplicate code-mode request ID 2",
            ),
        ),
        (
            "cell",
            Garbage(
                "unknown-delegate-id",
                frame(compact({**BASES[4], "id": 41})),
                complete=True,
                log="code-mode client returned unknown delegate request ID 41",
            ),
        ),
        ("hello", Garbage("truncated", b"\x05\x00", complete=False)),
        ("first", Garbage("duplicate-key", frame(_with_duplicate_key(HELLO)), complete=True)),
        ("hello", Garbage("nan", frame(_with_value(BASES[3], "id", "NaN")), complete=True)),
        ("cell", Garbage("unknown-field", frame(_with_unknown_field(EXECUTE, "x")), True)),
        ("cell", Garbage("wrong-type", frame(_with_value(BASES[3], "id", "1e3")), True)),
        ("hello", Garbage("missing-field", frame(compact({"type": "operation/cancel"})), True)),
        (
            "first",
            Garbage("wrong-tag", frame(compact({**HELLO, "type": "Connection/Hello"})), True),
        ),
        ("cell", Garbage("empty-payload", frame(b""), complete=True)),
        ("first", Garbage("truncated", frame(compact(HELLO))[:-1], complete=False)),
    ],
    ids=lambda value: value.kind if isinstance(value, Garbage) else value,
)
def test_pinned_examples(stage: str, garbage: Garbage) -> None:
    asyncio.run(scenario(stage, garbage))
