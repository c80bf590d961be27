"""The embedded session: :class:`LocalSession` runs cells in this process's JavaScript engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Final

import msgspec

from codemode.errors import CodeModeError
from codemode.protocol.constants import DEFAULT_EXEC_YIELD_TIME_MS
from codemode.protocol.identifiers import normalize_identifier
from codemode.protocol.session import (
    SESSION_SHUTTING_DOWN,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    StartedCell,
)
from codemode.protocol.types import (
    CellId,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    LiveCell,
    MissingCell,
    Result,
    ToolDefinition,
    WaitOutcome,
    WaitRequest,
)
from codemode.runtime.cell import Cell
from codemode.runtime.engine import NodeEngine

__all__ = ["InvalidLimitsError", "LocalSession", "LocalSessionProvider", "check_limits"]

logger = logging.getLogger("codemode.runtime")

_MIB: Final = 1024 * 1024
_ENCODER: Final = msgspec.json.Encoder()


class InvalidLimitsError(CodeModeError):
    """The runtime cannot enforce the requested session limits; ``detail`` says why."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"invalid code-mode session execution limits: {detail}")
        self.detail = detail


def check_limits(limits: CodeModeSessionCellExecutionLimits) -> None:
    """Raise :class:`InvalidLimitsError` for limits this runtime refuses (§13.10)."""
    heap = limits.max_heap_size_bytes
    if heap is not None and heap <= 0:
        raise InvalidLimitsError("max_heap_size_bytes must be greater than 0")


def _missing(cell_id: CellId) -> MissingCell:
    return MissingCell(Result(cell_id, [], f"exec cell {cell_id} not found"))


class LocalSession(CodeModeSession):
    """A session whose cells run in-process (one V8 isolate per cell)."""

    def __init__(
        self,
        engine: NodeEngine,
        delegate: CodeModeSessionDelegate,
        limits: CodeModeSessionCellExecutionLimits | None = None,
        *,
        store_load: bool = True,
    ) -> None:
        self.engine = engine
        self.delegate = delegate
        self.limits = limits or CodeModeSessionCellExecutionLimits()
        check_limits(self.limits)
        heap = self.limits.max_heap_size_bytes
        self._heap_mb = None if heap is None else max(1, math.ceil(heap / _MIB))
        self._store_load = store_load
        self._store: dict[str, str] = {}
        self._cells: dict[CellId, Cell] = {}
        self._next_cell = 1
        self._shutting_down = False
        self._shutdown_task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()

    # -- the session API ---------------------------------------------------------------------------

    async def execute(self, request: ExecuteRequest) -> StartedCell:
        self._check_open()
        await self.engine.start()
        self._check_open()
        cell_id = CellId(str(self._next_cell))
        self._next_cell += 1
        tools = list(request.enabled_tools)
        config = self._config(tools)
        cell = Cell(self, cell_id, request.tool_call_id, tools)
        cell.key = self.engine.run_cell(cell, request.source, config, self._heap_mb)
        self._cells[cell_id] = cell
        initial = cell.observe(self._yield_ms(request.yield_time_ms))
        return StartedCell.from_awaitable(cell_id, initial, lambda: self._abandon(cell_id))

    async def wait(self, request: WaitRequest) -> WaitOutcome:
        self._check_open()
        cell = self._cells.get(request.cell_id)
        if cell is None:
            return _missing(request.cell_id)
        return LiveCell(await cell.observe(self._yield_ms(request.yield_time_ms)))

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        self._check_open()
        cell = self._cells.get(cell_id)
        if cell is None:
            return _missing(cell_id)
        # Cancelling the caller does not stop the termination.
        return await asyncio.shield(cell.terminate())

    async def shutdown(self) -> None:
        if self._shutdown_task is None:
            self._shutting_down = True
            self._shutdown_task = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self) -> None:
        cells = list(self._cells.values())
        results = await asyncio.gather(
            *(self._retire(cell) for cell in cells), return_exceptions=True
        )
        for cell, outcome in zip(cells, results, strict=True):
            if isinstance(outcome, BaseException) and not cell.closed:
                logger.warning("shutdown: cell %s: %s", cell.cell_id, outcome)

    @staticmethod
    async def _retire(cell: Cell) -> None:
        # A termination already under way (an abandoned cell) is waited for, not repeated.
        if cell.terminating:
            await cell.wait_closed()
        elif not cell.closed:
            await cell.terminate()

    # -- helpers for cells ---------------------------------------------------------------------------

    def commit(self, writes: list[tuple[str, str]]) -> None:
        """Merge a naturally completed cell's store writes (per key, last writer wins)."""
        if self._store_load:
            self._store.update(writes)

    def forget(self, cell: Cell) -> None:
        """Remove a closed cell."""
        if self._cells.get(cell.cell_id) is cell:
            del self._cells[cell.cell_id]

    def _check_open(self) -> None:
        if self._shutting_down:
            raise CodeModeError(SESSION_SHUTTING_DOWN)

    def _yield_ms(self, requested: int | None) -> int:
        value = DEFAULT_EXEC_YIELD_TIME_MS if requested is None else requested
        cap = self.limits.max_yield_time_ms
        return value if cap is None else min(value, cap)

    def _config(self, tools: list[ToolDefinition]) -> str:
        seen: set[str] = set()
        callable_tools: list[tuple[str, int]] = []
        listed: list[dict[str, str]] = []
        for index, tool in enumerate(tools):
            identifier = normalize_identifier(tool.name)
            if identifier in seen:
                continue  # the first tool with an identifier wins (§4.2)
            seen.add(identifier)
            callable_tools.append((identifier, index))
            listed.append({"name": identifier, "description": tool.description})
        store = list(self._store.items()) if self._store_load else None
        return _ENCODER.encode({"tools": callable_tools, "all": listed, "store": store}).decode()

    def _abandon(self, cell_id: CellId) -> None:
        # Called when a StartedCell is abandoned, possibly from a finalizer.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._terminate_in_background, cell_id)

    def _terminate_in_background(self, cell_id: CellId) -> None:
        cell = self._cells.get(cell_id)
        if cell is None or cell.closed:
            return
        task = asyncio.ensure_future(cell.terminate())
        task.add_done_callback(lambda done: done.cancelled() or done.exception())


class LocalSessionProvider(CodeModeSessionProvider):
    """Creates :class:`LocalSession` objects sharing one JavaScript engine process.

    ``store_load=False`` removes ``store``/``load`` from every cell. Close with :meth:`aclose`.
    """

    def __init__(
        self,
        *,
        store_load: bool = True,
        warm_workers: int = 2,
        engine: NodeEngine | None = None,
    ) -> None:
        self.store_load = store_load
        self.engine = engine or NodeEngine(warm_workers=warm_workers)
        self._sessions: list[LocalSession] = []

    async def create_session(self, delegate: CodeModeSessionDelegate) -> LocalSession:
        return await self.create_session_with_limits(delegate, CodeModeSessionCellExecutionLimits())

    async def create_session_with_limits(
        self,
        delegate: CodeModeSessionDelegate,
        limits: CodeModeSessionCellExecutionLimits,
    ) -> LocalSession:
        check_limits(limits)
        await self.engine.start()
        session = LocalSession(self.engine, delegate, limits, store_load=self.store_load)
        self._sessions.append(session)
        return session

    async def aclose(self) -> None:
        """Shut down every session and stop the engine."""
        sessions, self._sessions = self._sessions, []
        await asyncio.gather(*(session.shutdown() for session in sessions))
        await self.engine.aclose()

    async def __aenter__(self) -> LocalSessionProvider:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
