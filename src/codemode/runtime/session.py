"""The embedded session: :class:`LocalSession` runs cells in an engine process of its own.

Sessions are kept apart by processes (decision 0006): each session takes a fresh, confined engine
from an :class:`EnginePool` when it first needs one, never shares it, and gives it back to the
kernel after ``idle_engine_timeout`` seconds without a live cell (the store lives here, in Python,
so nothing is lost; the next cell takes a fresh engine). ``shared_engine=True`` runs every session
of a provider in one engine: one trust domain, for callers whose sessions trust each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import Callable
from operator import itemgetter
from typing import Any, Final

import msgspec

from codemode.errors import CodeModeError, EngineLimitError
from codemode.protocol.arguments import (
    InvalidLimitsError,
    check_cell_id,
    check_execute_request,
    check_limits,
    check_wait_request,
)
from codemode.protocol.constants import DEFAULT_EXEC_YIELD_TIME_MS
from codemode.protocol.identifiers import normalize_identifier
from codemode.protocol.options import checked_count, checked_seconds
from codemode.protocol.texts import SESSION_SHUTTING_DOWN
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
from codemode.runtime import confinement
from codemode.runtime.budget import (
    HeldCharacters,
    ResidentMemory,
    default_held_chars,
    default_max_engines,
    physical_memory,
)
from codemode.runtime.cell import (
    MAX_PENDING_INPUT_CHARS,
    MAX_SESSION_BUFFERED_OUTPUT_CHARS,
    Cell,
    EarlyYield,
)
from codemode.runtime.engine import DEFAULT_MEMORY_CAP_BYTES, THREAD_CHARS, NodeEngine
from codemode.session import (
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    StartedCell,
)

__all__ = [
    "DEFAULT_MAX_ENGINES",
    "DEFAULT_MAX_HELD_CHARS",
    "DEFAULT_TOTAL_MEMORY_CAP_BYTES",
    "EnginePool",
    "InvalidLimitsError",
    "LocalSession",
    "LocalSessionProvider",
    "check_limits",
    "too_many_engines",
]

logger = logging.getLogger("codemode.runtime")

_MIB: Final = 1024 * 1024
_ENCODER: Final = msgspec.json.Encoder()
#: The most a session's store may hold (characters of keys and JSON values, and
#: :data:`STORE_ENTRY_CHARS` for each key).
MAX_STORE_CHARS: Final = 256 * 1024 * 1024
#: The least the characters held for the cells of all a provider's sessions may be limited to by
#: default: what one session may hold at its own bounds (store, unobserved output, unsettled
#: inputs), so that a lone session always has the room those bounds promise.
MIN_HELD_CHARS: Final = (
    MAX_STORE_CHARS + MAX_SESSION_BUFFERED_OUTPUT_CHARS + MAX_PENDING_INPUT_CHARS
)
#: By default a provider's sessions may hold a quarter of the machine's memory (in characters).
DEFAULT_MAX_HELD_CHARS: Final = default_held_chars(MIN_HELD_CHARS)
#: By default all engine processes of a provider may be resident in half the machine's memory
#: together (never less than one engine's own cap); past it the one that grew the most is stopped.
DEFAULT_TOTAL_MEMORY_CAP_BYTES: Final = max(
    DEFAULT_MEMORY_CAP_BYTES, (physical_memory() or 2 * DEFAULT_MEMORY_CAP_BYTES) // 2
)
#: What each stored key counts beyond its characters: Python and the engine pay for an entry as
#: such (≈150 bytes here), so a store of millions of tiny entries is bounded too.
STORE_ENTRY_CHARS: Final = 256
#: Store writes of at least this many entries are merged on a worker thread, off the event loop.
THREAD_WRITES: Final = 2048
#: Names each session's store in the engine processes (unique within this Python process).
_scopes: Final = itertools.count(1)
#: How long a session keeps its engine process without a live cell.
DEFAULT_IDLE_ENGINE_TIMEOUT: Final = 30.0
#: After a session takes an engine, how long its replacement waits before it starts: a Node
#: process's start (≈30 ms of CPU) would otherwise compete with the session's first cell. A
#: session that comes meanwhile starts an engine of its own at once.
REFILL_DELAY: Final = 0.25
#: How many engine processes one provider runs at once (warm ones included), by default: 256,
#: fewer where idle ones would take more than a quarter of the machine's memory (64 on 4 GiB),
#: and never fewer than 16. A client opening sessions and running a trivial cell in each makes
#: the host keep an engine per session until they idle out.
DEFAULT_MAX_ENGINES: Final = default_max_engines(256, 16)


def too_many_engines(bound: int) -> str:
    """The refusal of a cell when every one of the ``bound`` engine processes runs cells."""
    return (
        f"code-mode host has too many active sessions: all {bound} engine processes are "
        "running cells"
    )


class EnginePool:
    """Started engine processes, each handed out once and never reused by another session.

    At most ``max_engines`` processes run at once (``None``: no bound). At the bound, the engine of
    the session idle the longest is taken back (that session takes a fresh one for its next cell;
    its store lives in Python, nothing is lost); when every engine runs cells, :meth:`take`
    raises :class:`~codemode.errors.EngineLimitError` (:func:`too_many_engines`).
    """

    def __init__(
        self,
        *,
        size: int = 1,
        memory_cap_bytes: int = DEFAULT_MEMORY_CAP_BYTES,
        require_confinement: bool = False,
        node: str | None = None,
        max_engines: int | None = DEFAULT_MAX_ENGINES,
        resident: ResidentMemory | None = None,
    ) -> None:
        self.size = size
        self.memory_cap_bytes = memory_cap_bytes
        #: The resident memory of all its engines, against the provider's total cap.
        self.resident = ResidentMemory() if resident is None else resident
        self.require_confinement = require_confinement
        self.max_engines = max_engines
        self._node = node
        self._ready: list[NodeEngine] = []
        self._refill: asyncio.Task[None] | None = None
        self._refill_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._held = 0  # engines handed out (or being started for a taker), not yet given back
        self._filling = 0  # engines the refill is starting
        #: Engines of idle sessions, idle the longest first, and how to take each one back.
        self._reclaimable: dict[NodeEngine, Callable[[], bool]] = {}

    @property
    def engines(self) -> int:
        """Engine processes of this pool: held by sessions, warm, or starting."""
        return self._held + len(self._ready) + self._filling

    def _new(self) -> NodeEngine:
        return NodeEngine(
            node=self._node,
            memory_cap_bytes=self.memory_cap_bytes,
            require_confinement=self.require_confinement,
            resident=self.resident,
        )

    async def take(self, *, reclaim: bool = True) -> NodeEngine:
        """A started engine for one session; the pool starts its replacement in the background.

        At the bound, ``reclaim=False`` raises rather than take an idle session's engine back (a
        session that has no cell to run yet does not evict one that ran cells)."""
        if self._closed:
            raise CodeModeError("the engine pool is closed")
        engine = self._pop_ready()
        refill = self._refill
        if engine is None and refill is not None and not refill.done():
            # An engine is starting already (the host warms one while it handshakes): take it
            # rather than start a second one beside it.
            with contextlib.suppress(Exception):
                await asyncio.shield(refill)
            engine = self._pop_ready()
        if engine is None:
            self._make_room(reclaim)
            self._held += 1
            engine = self._new()
            # Shielded: a start cancelled half-way (its caller's connection ended) would leave
            # its child running, held by nothing; it finishes, and the engine is then closed.
            starting = asyncio.ensure_future(engine.start())
            try:
                await asyncio.shield(starting)
            except BaseException:
                self._held -= 1
                starting.add_done_callback(lambda _: _close_started(engine, starting))
                raise
        else:
            self._held += 1
        self._schedule_refill(REFILL_DELAY)
        return engine

    def _make_room(self, reclaim: bool) -> None:
        bound = self.max_engines
        while bound is not None and self.engines >= bound:
            if not reclaim or not self._reclaimable:
                raise EngineLimitError(too_many_engines(bound))
            engine = next(iter(self._reclaimable))
            give_back = self._reclaimable.pop(engine)
            give_back()  # a session that is busy again keeps it; the next is asked

    def idle(self, engine: NodeEngine, give_back: Callable[[], bool]) -> None:
        """``engine``'s session runs no cell: at the bound, ``give_back()`` may be called (it
        returns whether the engine was given back with :meth:`release`)."""
        self._reclaimable.pop(engine, None)
        self._reclaimable[engine] = give_back

    def busy(self, engine: NodeEngine) -> None:
        """``engine``'s session runs a cell again: it is not taken back."""
        self._reclaimable.pop(engine, None)

    def release(self, engine: NodeEngine) -> asyncio.Future[None]:
        """A session gives ``engine`` back: it is stopped (await the result to wait for that)."""
        self._reclaimable.pop(engine, None)
        self._held -= 1
        return _close_in_background(engine)

    def _pop_ready(self) -> NodeEngine | None:
        while self._ready:
            candidate = self._ready.pop(0)
            if candidate.running:
                return candidate
        return None

    async def warm(self) -> None:
        """Start the pool's engines now (e.g. while a host handshakes)."""
        if self._closed:
            return
        self._schedule_refill()
        if self._refill is not None:
            await asyncio.shield(self._refill)

    def _schedule_refill(self, delay: float = 0.0) -> None:
        if self._refill_timer is not None:
            self._refill_timer.cancel()
            self._refill_timer = None
        if self._closed or self.size == 0 or (self._refill is not None and not self._refill.done()):
            return
        if delay > 0:
            self._refill_timer = asyncio.get_running_loop().call_later(delay, self._schedule_refill)
            return
        self._refill = asyncio.ensure_future(self._fill())
        self._refill.add_done_callback(_log_failure)

    async def _fill(self) -> None:
        while not self._closed and len(self._ready) < self.size:
            if self.max_engines is not None and self.engines >= self.max_engines:
                return  # warm engines never push the sessions' own past the bound
            engine = self._new()
            self._filling += 1
            try:
                await engine.start()
            finally:
                self._filling -= 1
            if self._closed:
                await engine.aclose()
                return
            self._ready.append(engine)

    async def aclose(self) -> None:
        """Stop the idle engines (engines handed out belong to their sessions)."""
        self._closed = True
        if self._refill_timer is not None:
            self._refill_timer.cancel()
            self._refill_timer = None
        if self._refill is not None:
            # Not cancelled: an engine cancelled half-way through its start would leak its child.
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self._refill), 30)
        ready, self._ready = self._ready, []
        await asyncio.gather(*(engine.aclose() for engine in ready))


_closing: set[asyncio.Task[None]] = set()  # strong references until each close is done


def _close_started(engine: NodeEngine, starting: asyncio.Future[None]) -> None:
    """Close an engine whose taker gave up while it started (its start's outcome is dropped)."""
    if not starting.cancelled():
        starting.exception()
    _close_in_background(engine)


def _close_in_background(engine: NodeEngine) -> asyncio.Future[None]:
    task = asyncio.ensure_future(engine.aclose())
    _closing.add(task)
    task.add_done_callback(_closing.discard)
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.warning("codemode engine pool: could not start an engine: %s", error)


def _missing(cell_id: CellId) -> MissingCell:
    return MissingCell(Result(cell_id, [], f"exec cell {cell_id} not found"))


class _Held:
    """A count of a session's characters that moves its provider's shared count (``held``) by
    every change, so no place that changes it can forget the host's total."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_{name}"

    def __get__(self, session: LocalSession, owner: type | None = None) -> int:
        value: int = getattr(session, self._slot)
        return value

    def __set__(self, session: LocalSession, value: int) -> None:
        change = value - getattr(session, self._slot)
        setattr(session, self._slot, value)
        held = session.held
        held.chars += change
        before = session.held_chars
        session.held_chars = before + change
        if (before == 0) != (session.held_chars == 0):
            held.holders += 1 if before == 0 else -1


class LocalSession(CodeModeSession):
    """A session of the embedded runtime: its cells run in a separate engine process, one V8
    isolate per cell (the process is the session's own unless the provider shares one)."""

    #: Characters of the unsettled tool inputs and notification texts (cell.py bounds it).
    pending_input_chars = _Held()
    #: Characters its cells hold for observers (cell.py bounds it).
    buffered_output = _Held()
    #: The store's size (see :data:`MAX_STORE_CHARS`).
    store_chars = _Held()

    def __init__(
        self,
        engines: EnginePool | NodeEngine,
        delegate: CodeModeSessionDelegate,
        limits: CodeModeSessionCellExecutionLimits | None = None,
        *,
        store_load: bool = True,
        console: bool = False,
        idle_engine_timeout: float = DEFAULT_IDLE_ENGINE_TIMEOUT,
        on_closed: Callable[[LocalSession], None] | None = None,
        held: HeldCharacters | None = None,
    ) -> None:
        self._on_closed = on_closed
        # A NodeEngine is shared (and owned by the caller); a pool gives this session its own.
        self._engines = engines
        self.engine: NodeEngine | None = engines if isinstance(engines, NodeEngine) else None
        self._idle_timeout = idle_engine_timeout
        self._idle_timer: asyncio.TimerHandle | None = None
        self._taking: asyncio.Lock = asyncio.Lock()
        self._preparing: asyncio.Task[NodeEngine] | None = None
        self.pending_calls = 0  # unresolved nested calls and notifications of all cells
        self.callbacks_issued = 0  # nested calls and notifications its cells ever issued
        # What the session holds for its cells counts against its provider's shared limit too:
        # the _Held counts start at zero here, the only assignments that move nothing.
        self.held = HeldCharacters() if held is None else held
        self._pending_input_chars = self._buffered_output = self._store_chars = 0
        #: The three counts above together: what this session holds of the provider's count.
        self.held_chars = 0
        self.pending_input_values = 0  # JSON values of their inputs (at most; cell.py bounds it)
        self.pending_input_containers = 0  # their arrays and objects (at most; cell.py bounds it)
        self.delegate = delegate
        self.limits = limits or CodeModeSessionCellExecutionLimits()
        check_limits(self.limits)
        heap = self.limits.max_heap_size_bytes
        self._heap_mb = None if heap is None else max(1, math.ceil(heap / _MIB))
        self._store_load = store_load
        self._console = console
        self._store: dict[str, str] = {}
        self._scope = next(_scopes)
        self._committing = asyncio.Lock()
        # The engine (and its child's generation) that holds a copy of the whole store.
        self._store_copy: tuple[NodeEngine, int] | None = None
        self._cells: dict[CellId, Cell] = {}
        self._next_cell = 1
        self._shutting_down = False
        self._shutdown_task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()

    # -- the session API ---------------------------------------------------------------------------

    async def _engine(self, *, reclaim: bool = True) -> NodeEngine:
        async with self._taking:
            pool = self._engines
            if not isinstance(pool, EnginePool):
                await pool.start()  # the provider's shared engine
                return pool
            engine = self.engine
            if engine is not None and not engine.running:
                # Its process died or is ending: this session's next cells get a fresh one.
                self.engine = None
                pool.release(engine)
                engine = None
            if engine is None:
                engine = self.engine = await pool.take(reclaim=reclaim)
            pool.busy(engine)
            return engine

    def prepare_engine(self) -> None:
        """Take this session's engine in the background (``execute`` waits for it)."""
        # Without taking another session's engine back: at the bound, the first cell does that.
        task = asyncio.ensure_future(self._engine(reclaim=False))
        self._preparing = task
        task.add_done_callback(self._engine_prepared)

    def _engine_prepared(self, task: asyncio.Task[NodeEngine]) -> None:
        if task.cancelled():
            return
        if (error := task.exception()) is not None:
            # Reported by the execute that takes the engine again.
            logger.debug("codemode session: could not take an engine: %s", error)
        elif not self._cells:
            # Idle from the start: given back after the idle timeout, as after a last cell (a
            # session opened and never used kept its engine for ever).
            self._went_idle()

    def _went_idle(self) -> None:
        if isinstance(self._engines, EnginePool) and not self._shutting_down:
            self._cancel_idle()
            self._idle_timer = self._loop.call_later(self._idle_timeout, self._reap_if_idle)
            self._offer_engine()

    def _offer_engine(self) -> None:
        # An idle session's engine may be taken back by the pool at its bound.
        engine = self.engine
        if engine is not None and isinstance(self._engines, EnginePool) and not self._shutting_down:
            self._engines.idle(engine, self._reap_if_idle)

    async def execute(self, request: ExecuteRequest) -> StartedCell:
        check_execute_request(request)
        self._check_open()
        for _ in range(2):
            engine = await self._engine()
            self._check_open()
            self._cancel_idle()
            # Held while the store is copied: an idle session's engine is not taken back then.
            async with self._taking:
                scope = await self._copy_store(engine)
            self._check_open()
            if engine.running:
                break  # else it died while the store was copied to it: a fresh one, once
        cell_id = CellId(str(self._next_cell))
        self._next_cell += 1
        tools = list(request.enabled_tools)
        config = self._config(tools)
        cell = Cell(self, engine, cell_id, request.tool_call_id, tools)
        cell.key = engine.run_cell(cell, request.source, config, self._heap_mb, scope)
        self._cells[cell_id] = cell
        early = EarlyYield()
        initial = cell.attach(self._yield_ms(request.yield_time_ms), early)
        return StartedCell.from_awaitable(
            cell_id, initial, lambda: self._abandon(cell_id), yield_early=early.request
        )

    async def wait(
        self, request: WaitRequest, *, early_yield: asyncio.Event | None = None
    ) -> WaitOutcome:
        check_wait_request(request)
        self._check_open()
        cell = self._cells.get(request.cell_id)
        if cell is None or cell.concluded:
            return _missing(request.cell_id)
        yield_ms = self._yield_ms(request.yield_time_ms)
        if early_yield is None:
            return LiveCell(await cell.attach(yield_ms))
        early = EarlyYield()
        if early_yield.is_set():
            early.request()
            return LiveCell(await cell.attach(yield_ms, early))
        watcher = asyncio.ensure_future(early_yield.wait())

        def fired(done: asyncio.Future[Any]) -> None:
            if not done.cancelled():
                early.request()

        watcher.add_done_callback(fired)
        try:
            return LiveCell(await cell.attach(yield_ms, early))
        finally:
            watcher.cancel()

    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        check_cell_id(cell_id)
        self._check_open()
        cell = self._cells.get(cell_id)
        if cell is None or cell.concluded:
            return _missing(cell_id)
        # Cancelling the caller does not stop the termination.
        return await asyncio.shield(cell.terminate())

    async def shutdown(self) -> None:
        if self._shutdown_task is None:
            self._shutting_down = True
            self._shutdown_task = asyncio.ensure_future(self._shutdown())
            if (on_closed := self._on_closed) is not None:
                self._shutdown_task.add_done_callback(lambda _: on_closed(self))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self) -> None:
        cells = list(self._cells.values())
        # The pending callbacks of all cells are revoked newest first, across cells, before any
        # cell stops, as the upstream host revokes them at a shutdown (delegate/cancel 3, 2, 1
        # for cell 1's call 1 and cell 2's notification 2 and call 3).
        issued = [(place, token) for cell in cells for token, place in cell.issued.items()]
        for _, token in sorted(issued, key=itemgetter(0), reverse=True):
            token.cancel()
        results = await asyncio.gather(
            *(self._retire(cell) for cell in cells), return_exceptions=True
        )
        for cell, outcome in zip(cells, results, strict=True):
            if isinstance(outcome, BaseException) and not cell.closed:
                logger.warning("shutdown: cell %s: %s", cell.cell_id, outcome)
        self._cancel_idle()
        async with self._committing:
            # Its cells are gone and none of it will run again: the store gives its room back.
            self._store = {}
            self.store_chars = 0
        copy, self._store_copy = self._store_copy, None
        if copy is not None and copy[0].generation == copy[1]:
            copy[0].forget_store(self._scope)  # a shared engine outlives the session
        preparing = self._preparing
        if preparing is not None and not preparing.done():
            # Not cancelled: an engine cancelled half-way through its start would leak its child.
            with contextlib.suppress(Exception):
                await asyncio.shield(preparing)
        await self._release_engine()

    async def _release_engine(self) -> None:
        engine = self.engine
        if engine is not None and isinstance(self._engines, EnginePool):
            self.engine = None
            await self._engines.release(engine)

    def _cancel_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _reap_if_idle(self) -> bool:
        # After idle_engine_timeout, or when the pool at its bound takes the engine back.
        self._cancel_idle()
        engine = self.engine
        if (
            self._cells
            or engine is None
            or engine.live_cells
            or self._taking.locked()
            or not isinstance(self._engines, EnginePool)
        ):
            return False
        self.engine = None
        self._engines.release(engine)
        return True

    @staticmethod
    async def _retire(cell: Cell) -> None:
        # A termination already under way (an abandoned cell) is waited for, not repeated.
        if cell.terminating:
            await cell.wait_closed()
        elif not cell.closed:
            await cell.terminate()

    # -- helpers for cells ---------------------------------------------------------------------------

    async def commit(
        self,
        writes: list[tuple[str, str]],
        wanted: Callable[[], bool],
        sent_by: tuple[NodeEngine, int] | None = None,
    ) -> str | None:
        """Merge a naturally completed cell's store writes (per key, last writer wins), unless
        ``wanted()`` has turned false meanwhile (a termination won the race).

        ``sent_by`` (engine, cell key) names the engine whose child sent them: when it holds the
        store's copy, the writes are committed there by name (:meth:`NodeEngine.commit_writes`),
        not sent back; whatever happens they are dropped there otherwise.

        Returns an error text instead when the session's store would outgrow its limit (the
        writes are then discarded whole). Commits apply one at a time, in the order they come;
        many writes are merged on a worker thread, so that a cell's thousands of entries do not
        hold the event loop every session shares.
        """
        try:
            return await self._commit(writes, wanted, sent_by)
        finally:
            if sent_by is not None:
                sent_by[0].drop_writes(sent_by[1])  # not committed there: forgotten

    async def _commit(
        self,
        writes: list[tuple[str, str]],
        wanted: Callable[[], bool],
        sent_by: tuple[NodeEngine, int] | None,
    ) -> str | None:
        if not self._store_load or not writes:
            return None
        async with self._committing:
            if len(writes) < THREAD_WRITES:
                merged, size, chars = self._merge(writes)
            else:
                merged, size, chars = await asyncio.to_thread(self._merge, writes)
            if not wanted():
                return None
            if size > MAX_STORE_CHARS:
                return (
                    "exec cell store writes were discarded: the session store would exceed "
                    f"{MAX_STORE_CHARS} characters"
                )
            if (refusal := self.held_refusal(size - self.store_chars)) is not None:
                return f"exec cell store writes were discarded: they would pass {refusal}"
            self._store.update(merged)
            self.store_chars = size
            copy = self._store_copy
            if copy is not None and copy[0].generation == copy[1]:
                engine = copy[0]
                if (
                    sent_by is None
                    or sent_by[0] is not engine
                    or not engine.commit_writes(sent_by[1], self._scope)
                ):
                    await self._put_store(engine, list(merged.items()), chars)
        return None

    async def _put_store(
        self, engine: NodeEngine, entries: list[tuple[str, str]], chars: int
    ) -> None:
        # Under the commit lock (the store does not change meanwhile). A large store is encoded
        # off the event loop, which every session shares.
        if chars < THREAD_CHARS:
            engine.put_store(self._scope, entries, chars)
        else:
            await engine.put_store_off_loop(self._scope, entries)

    def _merge(self, writes: list[tuple[str, str]]) -> tuple[dict[str, str], int, int]:
        # The writes as texts, merged first: the engine is untrusted, and a key written twice
        # must be counted once (with its last value), or the count drifts from the store's real
        # size. Also the store's size with them, and their own characters. Reads the store
        # only (commits are one at a time: nothing changes it meanwhile).
        # Entry by entry, not dict(writes): on a worker thread, one C call over 200,000 entries
        # kept the GIL (and so the event loop) 30-60 ms; a loop of Python gives it back every
        # switch interval.
        merged: dict[str, str] = {}
        for key, value in writes:
            merged[key] = value
        size = self.store_chars
        chars = 0
        store = self._store
        for key, value in merged.items():
            old = store.get(key)
            size += len(value) + (STORE_ENTRY_CHARS + len(key) if old is None else -len(old))
            chars += len(key) + len(value)
        return merged, size, chars

    async def _copy_store(self, engine: NodeEngine) -> int | None:
        # The engine keeps a copy of the store (Python's is the one that counts): an engine
        # (or a child of it) that has none gets all of it, once; later commits follow it there.
        if not self._store_load:
            return None
        if self._store_copy != (engine, engine.generation):
            # Under the commit lock: no commit changes the store while it is copied, and the
            # cells of executes that come meanwhile wait for the copy.
            async with self._committing:
                generation = engine.generation
                if self._store_copy != (engine, generation):
                    # The counted size bounds the characters: a store of many small entries is
                    # sent without counting them again.
                    await self._put_store(engine, list(self._store.items()), self.store_chars)
                    self._store_copy = (engine, generation)
        return self._scope

    def held_room(self) -> int:
        """How many more characters this session may hold of its provider's shared count."""
        return self.held.room(self.held_chars)

    def held_refusal(self, size: int) -> str | None:
        """What ``size`` more characters would pass of the provider's shared limit (the end of
        the refusal's text), or ``None`` when they fit."""
        if size <= self.held_room():
            return None
        return self.held.refusal(self.held_chars, size)

    def forget(self, cell: Cell) -> None:
        """Remove a closed cell; an idle session's own engine is released after a while."""
        if self._cells.get(cell.cell_id) is cell:
            del self._cells[cell.cell_id]
        if not self._cells:
            self._went_idle()

    def hold_callback(
        self, task: asyncio.Future[Any], size: int, values: int = 0, containers: int = 0
    ) -> None:
        """Count a nested call or notification served by ``task``, ``size`` characters of its
        input or text, ``values`` JSON values of its input and ``containers`` arrays and objects
        among them, until ``task`` is done (one done callback for all counts)."""
        self.pending_calls += 1
        self.pending_input_chars += size
        self.pending_input_values += values
        self.pending_input_containers += containers

        def release(_: object) -> None:
            self.pending_calls -= 1
            self.pending_input_chars -= size
            self.pending_input_values -= values
            self.pending_input_containers -= containers

        task.add_done_callback(release)

    def _check_open(self) -> None:
        if self._shutting_down:
            raise CodeModeError(SESSION_SHUTTING_DOWN)

    def _yield_ms(self, requested: int | None) -> int:
        value = DEFAULT_EXEC_YIELD_TIME_MS if requested is None else requested
        cap = self.limits.max_yield_time_ms
        return value if cap is None else min(value, cap)

    def _config(self, tools: list[ToolDefinition]) -> str:
        # Tools whose names normalize to one identifier are all listed, and the last of them is
        # the one `tools[identifier]` calls (as the upstream host does).
        callable_tools: list[tuple[str, int]] = []
        listed: list[dict[str, str]] = []
        for index, tool in enumerate(tools):
            identifier = normalize_identifier(tool.name)
            callable_tools.append((identifier, index))
            listed.append({"name": identifier, "description": tool.description})
        config = {
            "tools": callable_tools,
            "all": listed,
            "store": self._store_load,
            "console": self._console,
        }
        return _ENCODER.encode(config).decode()

    def _abandon(self, cell_id: CellId) -> None:
        # Called when a StartedCell is abandoned, possibly from a finalizer.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._terminate_in_background, cell_id)

    def _terminate_in_background(self, cell_id: CellId) -> None:
        cell = self._cells.get(cell_id)
        if cell is None or cell.closed or cell.terminating:
            return  # a termination under way (a Terminate, the shutdown) is not repeated
        task = asyncio.ensure_future(cell.terminate())
        task.add_done_callback(lambda done: done.cancelled() or done.exception())


class LocalSessionProvider(CodeModeSessionProvider):
    """Creates :class:`LocalSession` objects, each with an engine process of its own.

    ``store_load=False`` removes ``store``/``load`` from every cell; ``console=True`` gives every
    cell a ``console`` whose ``log`` (and ``info``, ``warn``, ``error``, ``debug``) appends a
    text item (upstream cells have none). ``shared_engine=True`` runs
    all sessions in one engine process (one trust domain: an escaped cell could reach the other
    sessions' cells). ``memory_cap_bytes`` bounds each engine process, ``max_engines`` how many
    run at once (see :class:`EnginePool`; ``None``: no bound); ``require_confinement``
    refuses to start engines where an OS confinement layer is unavailable. ``max_held_chars``
    bounds the characters all sessions together hold in this process for their cells (stores,
    output not yet observed, tool inputs not yet answered; default: a quarter of the machine's
    memory, at least what one session may hold; ``None``: no bound), ``total_memory_cap_bytes``
    the resident memory of all its engine processes together (default: half the machine's
    memory, never below ``memory_cap_bytes``; past it the one that grew the most is stopped,
    its cells end; ``None``: no bound). Close with :meth:`aclose`.
    """

    def __init__(
        self,
        *,
        store_load: bool = True,
        console: bool = False,
        shared_engine: bool = False,
        warm_engines: int = 1,
        memory_cap_bytes: int = DEFAULT_MEMORY_CAP_BYTES,
        require_confinement: bool = False,
        idle_engine_timeout: float = DEFAULT_IDLE_ENGINE_TIMEOUT,
        engine: NodeEngine | None = None,
        max_engines: int | None = DEFAULT_MAX_ENGINES,
        max_held_chars: int | None = DEFAULT_MAX_HELD_CHARS,
        total_memory_cap_bytes: int | None = DEFAULT_TOTAL_MEMORY_CAP_BYTES,
    ) -> None:
        checked_count("warm_engines", warm_engines, minimum=0)
        #: What the cells of all its sessions hold in this process, against ``max_held_chars``.
        self.held = HeldCharacters(max_held_chars)
        checked_count("memory_cap_bytes", memory_cap_bytes)
        if max_engines is not None:
            checked_count("max_engines", max_engines)
        self.store_load = store_load
        self.console = console
        self.idle_engine_timeout = checked_seconds(
            "idle_engine_timeout", idle_engine_timeout, zero=True
        )
        if total_memory_cap_bytes == DEFAULT_TOTAL_MEMORY_CAP_BYTES:
            # The default is never below one engine's own cap, as documented: the built-in cap
            # is its floor, and one given here raises it too.
            total_memory_cap_bytes = max(total_memory_cap_bytes, memory_cap_bytes)
        resident = ResidentMemory(total_memory_cap_bytes)
        self.pool = EnginePool(
            size=warm_engines,
            memory_cap_bytes=memory_cap_bytes,
            require_confinement=require_confinement,
            max_engines=max_engines,
            resident=resident,
        )
        if engine is None and shared_engine:
            engine = NodeEngine(
                memory_cap_bytes=memory_cap_bytes,
                require_confinement=require_confinement,
                resident=resident,
            )
        #: The one engine of every session, when engines are shared.
        self.shared_engine = engine
        self._sessions: set[LocalSession] = set()  # until each one's shutdown is done

    async def create_session(self, delegate: CodeModeSessionDelegate) -> LocalSession:
        return await self.create_session_with_limits(delegate, CodeModeSessionCellExecutionLimits())

    async def create_session_with_limits(
        self,
        delegate: CodeModeSessionDelegate,
        limits: CodeModeSessionCellExecutionLimits,
    ) -> LocalSession:
        check_limits(limits)
        engines: EnginePool | NodeEngine = self.pool
        if self.shared_engine is not None:
            await self.shared_engine.start()
            engines = self.shared_engine
        session = LocalSession(
            engines,
            delegate,
            limits,
            store_load=self.store_load,
            console=self.console,
            idle_engine_timeout=self.idle_engine_timeout,
            on_closed=self._sessions.discard,
            held=self.held,
        )
        if self.shared_engine is None:
            if self.pool.require_confinement:  # refused at once, as its engine would refuse
                confinement.require_all()
            # The session is ready at once; its engine is taken meanwhile, and the first execute
            # waits for it (an engine that fails to start fails that execute, with the reason).
            session.prepare_engine()
        self._sessions.add(session)
        return session

    @property
    def live_cells(self) -> int:
        """How many cells the engines of this provider's sessions are running."""
        engines = {id(s.engine): s.engine for s in self._sessions if s.engine is not None}
        if self.shared_engine is not None:
            engines[id(self.shared_engine)] = self.shared_engine
        return sum(engine.live_cells for engine in engines.values())

    async def warm(self) -> None:
        """Start engines ahead of the first session (optional)."""
        if self.shared_engine is not None:
            await self.shared_engine.start()
        else:
            await self.pool.warm()

    async def aclose(self) -> None:
        """Shut down every session and stop the engines."""
        sessions = list(self._sessions)
        await asyncio.gather(*(session.shutdown() for session in sessions))
        await self.pool.aclose()
        loop = asyncio.get_running_loop()
        closing = [task for task in _closing if task.get_loop() is loop]
        if closing:
            await asyncio.wait(closing)
        if self.shared_engine is not None:
            await self.shared_engine.aclose()

    async def __aenter__(self) -> LocalSessionProvider:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
