"""Differences on the wire found by a differential fuzz of raw V1 frames against the upstream host,
each now followed, each a script run on our host and on the upstream binary of both releases
(``tests/upstream.py``; skipped without it).

A script writes frames and waits for a given number of answers before it goes on (so the upstream
host, which ends the connection when thousands of frames arrive in one burst, is never flooded);
what each host wrote, with the timing fields of the ``latest`` revision masked, and its exit
status must be the same. What the fuzz found and left is in ``docs/interop.md``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Final

import pytest

from tests.host import raw
from tests.host.raw import ECHO, HELLO, Step
from tests.upstream import DEFAULT_VERSION, LATEST_VERSION, unavailable_reason, upstream_host
from tests.wire import frame

BLOCKED: Final = "await new Promise(() => {})"
TOOL: Final = "const r = await tools.echo({}); text(typeof r)"


def send(*messages: dict[str, Any] | bytes) -> Step:
    """Frames written at once."""
    return ("send", b"".join(frame(message) for message in messages))


def expect(count: int) -> Step:
    return ("expect", count)


END: Final = ("end",)


def open_session(request_id: int) -> dict[str, Any]:
    return raw.request(request_id, {"method": "session/open", "sessionId": "s1"})


def refusal(request_id: int) -> dict[str, Any]:
    """A request answered at once with an error (a shutdown of an unknown session)."""
    return raw.request(request_id, {"method": "session/shutdown", "sessionId": "nope"})


def tool_result(delegate_id: int, result: bytes) -> bytes:
    """A ``delegate/response`` whose tool result is the JSON text ``result``."""
    return (
        b'{"type":"delegate/response","id":%d,"result":{"status":"ok","value":'
        b'{"type":"tool/result","result":%s}}}' % (delegate_id, result)
    )


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


OPENED: Final = [send(HELLO), expect(1), send(open_session(1)), expect(1)]

# serde_json reads at most 127 nested arrays and objects in a frame; the 128th is a decode
# error, a connection error. The envelope of a tool result nests 3 deep.
NESTING: Final = [
    *OPENED,
    send(raw.execute(2, TOOL, 5000, enabled_tools=[ECHO])),
    expect(2),
    send(tool_result(1, nested(124))),
    expect(2),
    send(raw.execute(3, TOOL, 5000, enabled_tools=[ECHO])),
    expect(2),
    send(tool_result(2, nested(125))),
    END,
]
# Far deeper than the parser's own recursion: a decode error like any other (it was a crash
# that went on writing the cell's revocation and outcome).
VERY_DEEP: Final = [
    *OPENED,
    send(raw.execute(2, TOOL, 5000, enabled_tools=[ECHO])),
    expect(2),
    send(tool_result(1, nested(100_000))),
    END,
]
VERY_DEEP_HELLO: Final = [send(b'{"type":"connection/hello","x":' + nested(100_000) + b"}"), END]


def _refusals(first: int, last: int, chunk: int = 64) -> list[Step]:
    steps: list[Step] = []
    for start in range(first, last + 1, chunk):
        ids = range(start, min(start + chunk, last + 1))
        steps += [send(*(refusal(request_id) for request_id in ids)), expect(len(ids))]
    return steps


# The last 4096 finished request ids are remembered, in the order they finished: a wait that
# finishes after 4096 later requests is still remembered, the oldest ones are forgotten and may
# be used again (each reuse is remembered anew), and a remembered one ends the connection.
REUSED_IDS: Final = [
    *OPENED,
    send(raw.execute(2, BLOCKED, 50)),
    expect(2),
    send(
        raw.request(
            3,
            {
                "method": "session/wait",
                "sessionId": "s1",
                "request": {"cell_id": "1", "yield_time_ms": 60_000},
            },
        )
    ),
    *_refusals(4, 4099),
    send(raw.request(4100, {"method": "session/terminate", "sessionId": "s1", "cellId": "1"})),
    expect(3),
    send(refusal(4)),
    expect(1),
    send(refusal(6)),
    expect(1),
    send(refusal(3)),
    END,
]

# A tool result reaches the cell as the JSON text it came in: -0 stays negative zero and an
# integer past a double's range is Infinity (the engine re-encoded it: 0 and null).
NUMBERS_SHOWN: Final = (
    "const r = await tools.echo({}); "
    "text(String([Object.is(r.z, -0), r.big, Object.is(r.i, -0), r.tiny, r.list]))"
)
NUMBERS: Final = [
    *OPENED,
    send(raw.execute(2, NUMBERS_SHOWN, 5000, enabled_tools=[ECHO])),
    expect(2),
    send(
        tool_result(
            1, b'{"z":-0.0,"big":1' + b"0" * 400 + b',"i":-0,"tiny":1e-400,"list":[-0.0,2.50]}'
        )
    ),
    expect(2),
    END,
]

SCRIPTS: Final = {
    "numbers of a tool result as they came": NUMBERS,
    "nesting depth 127 read, 128 refused": NESTING,
    "nesting 100000 deep after the hello": VERY_DEEP,
    "nesting 100000 deep in the first frame": VERY_DEEP_HELLO,
    "request ids reused after 4096 finished": REUSED_IDS,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", [DEFAULT_VERSION, LATEST_VERSION])
async def test_hosts_answer_the_same_frames(version: str) -> None:
    binary = upstream_host(version)
    if binary is None:
        pytest.skip(unavailable_reason(version))
    theirs = [str(binary), "--listen", "stdio"]
    names = list(SCRIPTS)
    results = await asyncio.gather(
        *(
            raw.exchange(command, SCRIPTS[name])
            for name in names
            for command in (raw.our_host(version), theirs)
        )
    )
    unexpected = []
    for index, name in enumerate(names):
        mine, upstream = results[2 * index], results[2 * index + 1]
        if mine != upstream:
            unexpected.append(
                f"{name}: ours exit {mine.status}, {len(mine.frames)} frames, last "
                f"{mine.frames[-3:]}\n  upstream exit {upstream.status}, "
                f"{len(upstream.frames)} frames, last {upstream.frames[-3:]}"
            )
    assert not unexpected, "\n".join(unexpected)


@pytest.mark.timeout(10)
def test_host_reader_refuses_the_nesting_upstream_refuses() -> None:
    """The host's reader alone (no upstream needed): brackets inside strings do not count, and
    nesting too deep for the parser itself is a decode error, not a crash."""
    from codemode.errors import FrameError, FrameErrorKind
    from codemode.protocol.v1 import messages as wire
    from codemode.protocol.v1.codec import UPSTREAM_MAX_NESTING, MessageDecoder

    decoder = MessageDecoder[wire.ClientToHost](wire.ClientToHost, max_depth=UPSTREAM_MAX_NESTING)
    tricky = b'["[[{{\\"[[", ' + nested(123) + b"]"  # 124 deep inside the 3 of the envelope
    assert isinstance(decoder.decode(tool_result(1, tricky)), wire.DelegateResponseMessage)
    for too_deep in (nested(125), b'["]]"' + b"," + nested(124) + b"]", nested(100_000)):
        with pytest.raises(FrameError) as caught:
            decoder.decode(tool_result(1, too_deep))
        assert caught.value.kind is FrameErrorKind.INVALID_JSON
        assert str(caught.value) == "failed to decode code-mode IPC frame: recursion limit exceeded"
    with pytest.raises(FrameError, match="recursion limit exceeded"):
        MessageDecoder().decode(nested(100_000))  # no limit asked for: still no crash


@pytest.mark.timeout(10)
def test_a_float_beyond_the_double_range_is_not_strict_json() -> None:
    """§2.1: a number written as a float that does not fit a finite double is refused, by both
    parsers (upstream reads it as ``Infinity``, docs/interop.md). An integer of any length is
    read exactly (the cell sees one beyond the double range as ``null``, upstream ``Infinity``)."""
    from codemode.errors import FrameError
    from codemode.protocol.v1 import messages as wire
    from codemode.protocol.v1.codec import MessageDecoder

    decoder = MessageDecoder[wire.ClientToHost](wire.ClientToHost)
    largest = int(sys.float_info.max)
    for fits in (str(largest).encode(), b"1" + b"0" * 400, b'"' + b"9" * 400 + b'"'):
        assert isinstance(decoder.decode(tool_result(1, fits)), wire.DelegateResponseMessage)
    for beyond in (b"1e400", b"[-1.5e309]"):
        with pytest.raises(FrameError, match="out of range"):
            decoder.decode(tool_result(1, beyond))
        with pytest.raises(FrameError, match="out of range"):  # the large-payload parser too
            decoder.decode(tool_result(1, beyond + b" " * 300_000))
