"""Push-mode WebSocket transports: each message reaches the sink from the socket's
``data_received`` (no reader task), back-pressure pauses reading, ends and failures are reported,
and a dual pair pushes both lanes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import Server, ServerConnection, serve

from codemode.protocol.v1.lanes import Lane
from codemode.transports.base import TextMessageReceived, TransportError
from codemode.transports.websocket import (
    PushClientConnection,
    PushServerConnection,
    WebSocketTransport,
)


def frame(payload: bytes) -> bytes:
    """One V1 frame: a little-endian length prefix and the payload."""
    return len(payload).to_bytes(4, "little") + payload


@dataclass
class Listener:
    server: Server
    url: str
    accepted: asyncio.Queue[ServerConnection] = field(default_factory=asyncio.Queue)


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    """A server whose accepted (pushing) connections wait in a queue until closed."""
    accepted: asyncio.Queue[ServerConnection] = asyncio.Queue()

    async def handler(connection: ServerConnection) -> None:
        await accepted.put(connection)
        await connection.wait_closed()

    server = await serve(
        handler,
        "127.0.0.1",
        0,
        create_connection=PushServerConnection,
        compression=None,
        close_timeout=1.0,
        max_size=8 << 20,
        write_limit=1 << 20,
    )
    port = next(iter(server.sockets)).getsockname()[1]
    yield Listener(server, f"ws://127.0.0.1:{port}", accepted)
    server.close()
    await server.wait_closed()


async def dial(listener: Listener) -> tuple[ClientConnection, ServerConnection]:
    client = await connect(
        listener.url,
        create_connection=PushClientConnection,
        compression=None,
        close_timeout=1.0,
        max_size=8 << 20,
    )
    return client, await listener.accepted.get()


async def dial_pushing(
    listener: Listener,
) -> tuple[ClientConnection, WebSocketTransport, list[bytes]]:
    """A client, the server side's transport, and the messages pushed to its sink."""
    client, accepted = await dial(listener)
    transport = WebSocketTransport(accepted)
    seen: list[bytes] = []
    transport.push_to(lambda data, lane: seen.append(data))
    return client, transport, seen


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition`` holds (the test's own timeout bounds it)."""
    while not condition():
        await asyncio.sleep(0.001)


async def test_messages_are_pushed_from_data_received_with_no_task_running(
    listener: Listener,
) -> None:
    client, accepted = await dial(listener)
    await client.send(frame(b"early"))
    assert isinstance(accepted, PushServerConnection)
    await until(lambda: bool(accepted._waiting))  # waits, reading paused, for a transport
    transport = WebSocketTransport(accepted)
    seen: list[tuple[bytes, Lane, asyncio.Task[object] | None]] = []
    transport.push_to(lambda data, lane: seen.append((data, lane, asyncio.current_task())))
    # What arrived before the sink comes out of receive(), then messages are pushed.
    assert await transport.receive() == (frame(b"early"), Lane.CONTROL)
    for number in range(20):
        await client.send(frame(b"m%d" % number))
    await until(lambda: len(seen) == 20)
    assert [data for data, _, _ in seen] == [frame(b"m%d" % n) for n in range(20)]
    assert {lane for _, lane, _ in seen} == {Lane.CONTROL}
    assert {task for _, _, task in seen} == {None}  # in the socket's callback, not a task
    await client.close()
    assert await transport.receive() is None  # a clean close is a clean end
    await transport.close()


async def test_every_message_goes_to_the_sink_as_it_is(listener: Listener) -> None:
    """The transport does not look inside: the consumer (``receive_frame``) judges a message."""
    client, transport, seen = await dial_pushing(listener)
    await client.send(frame(b"one"))
    await client.send(frame(b"two") + b"extra")
    await client.send(frame(b"three"))
    await client.close()
    assert await transport.receive() is None  # the clean end, after every message was pushed
    assert seen == [frame(b"one"), frame(b"two") + b"extra", frame(b"three")]
    await transport.close()


async def test_a_text_message_ends_the_connection_after_what_came_before(
    listener: Listener,
) -> None:
    client, transport, seen = await dial_pushing(listener)
    await client.send(frame(b"one"))
    await client.send("hello")
    with pytest.raises(TextMessageReceived):
        await transport.receive()
    assert seen == [frame(b"one")]
    await transport.close()
    await client.close()


async def test_a_failing_sink_ends_the_connection_with_its_error(listener: Listener) -> None:
    client, accepted = await dial(listener)
    transport = WebSocketTransport(accepted)

    def sink(data: bytes, lane: Lane) -> None:
        raise ValueError("consumer bug")

    transport.push_to(sink)
    await client.send(frame(b"one"))
    with pytest.raises(ValueError, match="consumer bug"):
        await transport.receive()
    await transport.close()
    await client.close()


async def test_reading_pauses_while_writes_back_up_and_resumes_when_they_drain(
    listener: Listener,
) -> None:
    client, accepted = await dial(listener)
    host = WebSocketTransport(accepted)  # pauses while backlogged (the host's side)
    big = frame(b"x" * (2 << 20))
    seen: list[bytes] = []

    def answer(data: bytes, lane: Lane) -> None:
        seen.append(data)
        host.send(big)  # every request gets a 2 MiB answer

    host.push_to(answer)

    def answered_or_paused(count: int) -> Callable[[], bool]:
        return lambda: len(seen) == count or not socket.is_reading()

    # The client does not read: its transport has no sink, so it pauses after one message.
    peer = WebSocketTransport(client, pause_while_backlogged=False)
    socket = accepted.transport
    sent = 0
    while socket.is_reading():
        await client.send(frame(b"request %d" % sent))
        sent += 1
        await until(answered_or_paused(sent))
    assert socket.get_write_buffer_size() > (1 << 20)  # stopped because the writes backed up
    paused_at = len(seen)
    for _ in range(3):  # sent while paused: not read yet
        await client.send(frame(b"request %d" % sent))
        sent += 1
    # The client reads everything it was sent; the host's writes drain and it reads again.
    answers = 0
    while answers < sent:
        item = await peer.receive()
        assert item == (big, Lane.CONTROL)
        answers += 1
    assert len(seen) == sent > paused_at
    assert socket.is_reading()
    await peer.close()
    await host.close()


async def test_a_peer_that_dies_inside_a_message_fails_the_connection(
    listener: Listener,
) -> None:
    client, transport, seen = await dial_pushing(listener)
    await client.send(frame(b"whole"))
    # Half of a binary WebSocket frame (masked, 100-byte payload announced), then the TCP
    # connection drops.
    client.transport.write(bytes([0x82, 0x80 | 100]) + b"\0\0\0\0" + b"y" * 40)
    client.transport.abort()
    with pytest.raises(TransportError, match="WebSocket"):
        await transport.receive()
    assert seen == [frame(b"whole")]
    with pytest.raises(TransportError):  # the end stays
        await transport.receive()
    await transport.close()


def fragments(message: bytes, size: int) -> list[bytes]:
    """``message`` in fragments of ``size`` bytes, a few empty ones among them."""
    chunks = [message[i : i + size] for i in range(0, len(message), size)]
    for place in (1, 100, 4000):
        chunks.insert(place, b"")
    return chunks


@pytest.mark.timeout(30)
async def test_a_message_in_any_number_of_fragments_is_taken_on_both_sides(
    listener: Listener,
) -> None:
    # More fragments than the 4096 once allowed (Go's gorilla/websocket writes one frame per
    # 4 KiB: 16 MiB and more came in over 4096); only the message size is bounded.
    client, accepted = await dial(listener)
    host = WebSocketTransport(accepted)
    peer = WebSocketTransport(client, pause_while_backlogged=False)
    seen: list[bytes] = []
    host.push_to(lambda data, lane: seen.append(data))
    upward = frame(bytes(range(256)) * 2400)  # 614,400 bytes in 6,144 fragments
    await client.send(fragments(upward, 100))
    await until(lambda: bool(seen))
    assert seen == [upward]
    downward = frame(b"d" * 500_000)
    await accepted.send(fragments(downward, 64))  # 7,813 fragments
    assert await peer.receive() == (downward, Lane.CONTROL)
    await peer.close()
    await host.close()


@pytest.mark.timeout(30)
async def test_a_message_of_endless_empty_fragments_fails_the_connection(
    listener: Listener,
) -> None:
    # They add nothing to its size, so the size limit alone would never end it.
    client, transport, seen = await dial_pushing(listener)
    client.transport.write(bytes([0x02, 0x81]) + b"\0\0\0\0" + b"x")  # a first fragment
    empty = bytes([0x00, 0x80]) + b"\0\0\0\0"  # masked CONT frames without payload
    client.transport.write(empty * 4097)
    with pytest.raises(
        TransportError, match=r"^WebSocket closed with code 1009: too many empty fragments$"
    ):
        await transport.receive()
    assert seen == []
    await transport.close()
    await client.close()


async def test_dual_pair_pushes_both_lanes_and_either_end_ends_it(listener: Listener) -> None:
    client_control, host_control = await dial(listener)
    host = WebSocketTransport(host_control)
    peer = WebSocketTransport(client_control, pause_while_backlogged=False)
    seen: list[tuple[bytes, Lane]] = []
    host.push_to(lambda data, lane: seen.append((data, lane)))
    received: list[tuple[bytes, Lane]] = []
    peer.push_to(lambda data, lane: received.append((data, lane)))
    host.send(frame(b"bulk early"), Lane.BULK)  # waits for the bulk socket
    assert not host.dual
    client_bulk, host_bulk = await dial(listener)
    host.attach_bulk(host_bulk)
    peer.attach_bulk(client_bulk)
    assert host.dual and peer.dual
    peer.send(frame(b"on control"))
    peer.send(frame(b"on bulk"), Lane.BULK)
    host.send(frame(b"answer"), Lane.BULK)
    await until(lambda: len(seen) == 2 and len(received) == 2)
    assert sorted(seen) == [(frame(b"on bulk"), Lane.BULK), (frame(b"on control"), Lane.CONTROL)]
    assert received == [(frame(b"bulk early"), Lane.BULK), (frame(b"answer"), Lane.BULK)]
    with pytest.raises(RuntimeError):
        host.attach_bulk(host_bulk)
    await client_bulk.close()  # closing either socket ends the connection
    assert await host.receive() is None
    await host.close()
    await peer.close()
    assert host_control.state.name == "CLOSED"


async def test_pause_reading_ends_the_pending_receive_and_the_next_one_reads_again(
    listener: Listener,
) -> None:
    client, accepted = await dial(listener)
    transport = WebSocketTransport(accepted)
    seen: list[bytes] = []
    transport.push_to(lambda data, lane: seen.append(data))
    pending = asyncio.ensure_future(transport.receive())
    await asyncio.sleep(0)
    transport.pause_reading()
    assert await pending is None
    assert not accepted.transport.is_reading()
    receiving = asyncio.ensure_future(transport.receive())
    await client.send(frame(b"after"))
    await until(lambda: seen == [frame(b"after")])
    receiving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await receiving
    await client.close()
    await transport.close()


async def test_a_plain_library_connection_is_refused(listener: Listener) -> None:
    async with connect(listener.url) as plain:
        with pytest.raises(TypeError, match="PushClientConnection"):
            WebSocketTransport(plain)
