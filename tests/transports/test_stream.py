"""Push-mode stream transports: reads reach the consumer in the iteration that read them."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest

from codemode.protocol.v1.lanes import Lane
from codemode.transports.stream import StreamTransport, pipe_transport


@pytest.fixture
async def piped() -> AsyncIterator[tuple[StreamTransport, int]]:
    """A push-mode transport reading a pipe, and the pipe's write end."""
    read_end, write_end = os.pipe()
    transport = await pipe_transport(os.fdopen(read_end, "rb", 0), None)
    yield transport, write_end
    await transport.close()
    with contextlib.suppress(OSError):
        os.close(write_end)


async def settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_reads_before_a_sink_come_out_of_receive_then_reads_are_pushed(
    piped: tuple[StreamTransport, int],
) -> None:
    transport, write_end = piped
    assert transport.pushes
    os.write(write_end, b"early")
    await settled()
    seen: list[tuple[bytes, Lane]] = []
    transport.push_to(lambda data, lane: seen.append((data, lane)))
    os.write(write_end, b"later")  # must not overtake what arrived before the sink
    await settled()
    assert seen == []
    assert await transport.receive() == (b"earlylater", Lane.CONTROL)
    os.write(write_end, b"pushed")
    await settled()
    assert seen == [(b"pushed", Lane.CONTROL)]
    os.close(write_end)
    assert await asyncio.wait_for(transport.receive(), 5) is None


async def test_without_a_sink_receive_returns_what_was_read(
    piped: tuple[StreamTransport, int],
) -> None:
    transport, write_end = piped
    receiving = asyncio.ensure_future(transport.receive())
    await settled()
    os.write(write_end, b"pulled")
    assert await asyncio.wait_for(receiving, 5) == (b"pulled", Lane.CONTROL)
    os.close(write_end)
    assert await asyncio.wait_for(transport.receive(), 5) is None


async def test_a_pushed_read_is_handled_without_a_task_waking(
    piped: tuple[StreamTransport, int],
) -> None:
    transport, write_end = piped
    tasks: list[asyncio.Task[object] | None] = []
    transport.push_to(lambda data, lane: tasks.append(asyncio.current_task()))
    receiving = asyncio.ensure_future(transport.receive())
    os.write(write_end, b"x")
    await settled()
    assert tasks == [None]  # called from the pipe's data_received, not from a reader task
    assert not receiving.done()  # receive() waits for the end, not for data
    os.close(write_end)
    assert await asyncio.wait_for(receiving, 5) is None


async def test_pausing_returns_an_empty_read_and_the_next_receive_resumes(
    piped: tuple[StreamTransport, int],
) -> None:
    transport, write_end = piped
    seen: list[bytes] = []

    def sink(data: bytes, lane: Lane) -> None:
        seen.append(data)
        transport.pause_reading()

    transport.push_to(sink)
    receiving = asyncio.ensure_future(transport.receive())
    os.write(write_end, b"one")
    assert await asyncio.wait_for(receiving, 5) == (b"", Lane.CONTROL)
    os.write(write_end, b"two")
    await settled()
    assert seen == [b"one"]  # paused: not read
    receiving = asyncio.ensure_future(transport.receive())
    await settled()
    assert seen == [b"one", b"two"]
    assert await asyncio.wait_for(receiving, 5) == (b"", Lane.CONTROL)


async def test_a_sink_that_fails_ends_the_stream_with_its_error(
    piped: tuple[StreamTransport, int],
) -> None:
    transport, write_end = piped

    def sink(data: bytes, lane: Lane) -> None:
        raise ValueError("bug in the consumer")

    transport.push_to(sink)
    receiving = asyncio.ensure_future(transport.receive())
    os.write(write_end, b"x")
    with pytest.raises(ValueError, match="bug in the consumer"):
        await asyncio.wait_for(receiving, 5)


async def test_close_ends_a_pending_receive(piped: tuple[StreamTransport, int]) -> None:
    transport, _ = piped
    transport.push_to(lambda data, lane: None)
    receiving = asyncio.ensure_future(transport.receive())
    await settled()
    await transport.close()
    assert await asyncio.wait_for(receiving, 5) is None


async def test_a_pulling_transport_refuses_a_sink() -> None:
    transport = StreamTransport(asyncio.StreamReader(), None)
    assert not transport.pushes
    with pytest.raises(RuntimeError):
        transport.push_to(lambda data, lane: None)


async def test_unsent_counts_what_the_peer_has_not_read_until_it_drains_even_after_close() -> None:
    loop = asyncio.get_running_loop()
    read_end, write_end = os.pipe()
    pipe, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(write_end, "wb", 0)
    )
    writer = asyncio.StreamWriter(pipe, protocol, None, loop)
    transport = StreamTransport(asyncio.StreamReader(), writer)
    assert transport.unsent() == 0
    transport.send(b"x" * (1 << 20))
    assert transport.unsent() > (1 << 20) - (1 << 17)  # a pipe holds far less than 1 MiB
    await transport.close()  # what was queued still drains
    reader = os.fdopen(read_end, "rb", 0)
    read = 0
    while read < 1 << 20:
        read += len(await asyncio.to_thread(reader.read, 1 << 16))
        await asyncio.sleep(0.01)
    reader.close()
    assert transport.unsent() == 0
    assert StreamTransport(asyncio.StreamReader(), None).unsent() == 0
