"""A loopback TCP proxy for tests of peers that go silent without closing."""

from __future__ import annotations

import asyncio


class FreezingProxy:
    """A loopback TCP proxy to ``port`` that can stop forwarding while it keeps both sockets open:
    a peer gone silent (stopped, or a network path that drops everything) without closing."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.frozen = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, upstream_writer]
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            task = asyncio.create_task(self._forward(source, sink))
            self._tasks.add(task)

    async def _forward(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while not self.frozen.is_set():
            data = await source.read(65536)
            if not data or self.frozen.is_set():
                return
            sink.write(data)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
