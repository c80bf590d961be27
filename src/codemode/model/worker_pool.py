"""Worker threads that run sync tools off the event loop, handed over in batches.

``asyncio.to_thread`` pays, per call, a ``concurrent.futures`` future chained to an asyncio one
and a write to the loop's self-pipe; and a burst of calls wakes up to ``cpu_count() + 4`` threads
that then fight over the GIL. Here calls go into one queue, which a *running* worker drains on
its own (a parked worker is woken only when no worker runs), and results go back through a
per-loop outbox that costs one ``call_soon_threadsafe`` per batch the loop has not collected
yet, not one per call. A worker that has been inside one call for ``stall`` seconds while calls
wait is considered blocked: more workers are started (up to ``max_workers``), so that one slow
tool never holds the others up for longer than that.

Queued calls wait in lanes (a registry gives each cell its own) that take turns: a cell that queues
a thousand slow calls holds up another cell's call by one call, not by the thousand, when every
worker is busy.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Final

__all__ = ["WorkerPool", "shared_pool"]

#: How long a worker may sit in one call while others wait before more workers start: above
#: the GIL's switch interval (5 ms), so a worker that only waited for the GIL is not "stuck".
STALL_SECONDS: Final = 0.01
#: A worker parked this long ends (the next call starts one again).
IDLE_SECONDS: Final = 60.0


class _Outbox:
    """Results for one event loop; one wake-up per batch the loop has not collected yet."""

    __slots__ = ("__weakref__", "check_armed", "loop", "posted", "results")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.results: deque[tuple[asyncio.Future[Any], bool, Any]] = deque()
        self.posted = False
        # Per loop: a loop closed with its check pending must not disarm the others'.
        self.check_armed = False

    def put(self, future: asyncio.Future[Any], ok: bool, value: Any) -> None:
        """On a worker: queue a result; wake the loop unless a wake-up is already on its way."""
        self.results.append((future, ok, value))
        if not self.posted:
            self.posted = True
            try:
                self.loop.call_soon_threadsafe(self.deliver)
            except RuntimeError:  # the loop is closed: nobody waits for these results
                self.results.clear()

    def deliver(self) -> None:
        """On the loop: settle every result queued so far."""
        # Cleared first: a result queued after this line posts a wake-up of its own, one
        # queued before it is drained below (deque appends and pops are atomic).
        self.posted = False
        results = self.results
        while results:
            future, ok, value = results.popleft()
            if future.done():  # a cancelled call's late result is dropped
                continue
            if ok:
                future.set_result(value)
            elif isinstance(value, StopIteration):  # a future refuses it (as generators do)
                future.set_exception(RuntimeError(f"the function raised {value!r}"))
            else:
                future.set_exception(value)


#: A queued call: function, args, kwargs, the caller's context, its future, its loop's outbox.
_Call = tuple[
    Callable[..., Any],
    tuple[Any, ...],
    dict[str, Any],
    contextvars.Context,
    "asyncio.Future[Any]",
    _Outbox,
]


class _Worker:
    __slots__ = ("busy_since", "wake")

    def __init__(self) -> None:
        self.wake = threading.Lock()  # held while parked; released to wake the worker
        self.wake.acquire()
        self.busy_since = 0.0  # when its current call began; 0 between calls


class WorkerPool:
    """Threads that run sync callables for coroutines, with batched hand-offs both ways."""

    def __init__(self, max_workers: int | None = None, *, stall: float = STALL_SECONDS) -> None:
        self._max_workers = max_workers or min(32, (os.cpu_count() or 1) + 4)
        self._stall = stall
        self._lock = threading.Lock()
        # Queued calls by lane, and the lanes that have some in turn order (both under _lock).
        self._lanes: dict[Hashable, deque[_Call]] = {}
        self._turns: deque[tuple[Hashable, deque[_Call]]] = deque()
        self._queued = 0
        self._running: list[_Worker] = []
        self._parked: list[_Worker] = []
        self._outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Outbox] = (
            weakref.WeakKeyDictionary()
        )
        self._last_outbox: _Outbox | None = None

    @property
    def workers(self) -> int:
        """How many worker threads exist (running or parked)."""
        return len(self._running) + len(self._parked)

    @property
    def queued(self) -> int:
        """How many calls wait for a worker."""
        return self._queued

    async def run(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` in a worker thread, in a copy of the current context
        (as ``asyncio.to_thread``). Cancelling the caller does not interrupt a call that has
        begun (threads cannot be interrupted): its result is dropped; one not yet begun never
        runs."""
        return await self.submit(function, args, kwargs)

    def submit(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        lane: Hashable = None,
    ) -> asyncio.Future[Any]:
        """Queue a call as :meth:`run` does; the future settles as the call does (cancel it to
        give up on the call). Calls of one ``lane`` run in order; lanes take turns."""
        loop = asyncio.get_running_loop()
        outbox = self._last_outbox
        if outbox is None or outbox.loop is not loop:
            outbox = self._outbox(loop)
        future = loop.create_future()
        call = (function, args, kwargs, contextvars.copy_context(), future, outbox)
        with self._lock:
            queue = self._lanes.get(lane)
            if queue is None:
                queue = self._lanes[lane] = deque()
                self._turns.append((lane, queue))
            queue.append(call)
            self._queued += 1
        if not self._running:
            self._start_one()
        elif not outbox.check_armed:
            outbox.check_armed = True
            loop.call_later(self._stall, self._check, outbox)
        return future

    def _outbox(self, loop: asyncio.AbstractEventLoop) -> _Outbox:
        outbox = self._outboxes.get(loop)
        if outbox is None:
            outbox = self._outboxes[loop] = _Outbox(loop)
        self._last_outbox = outbox
        return outbox

    def _start_one(self) -> None:
        """Wake a parked worker, or start one; nothing if at the limit."""
        with self._lock:
            if not self._queued:
                return
            if self._parked:
                worker = self._parked.pop()
                self._running.append(worker)
                worker.wake.release()
            elif len(self._running) < self._max_workers:
                worker = _Worker()
                worker.wake.release()  # starts running
                self._running.append(worker)
                threading.Thread(
                    target=self._work, args=(worker,), name="codemode-tool", daemon=True
                ).start()

    def _check(self, outbox: _Outbox) -> None:
        """On a loop, ``stall`` after calls queued behind running workers: if every running
        worker is still inside a call begun that long ago, start workers for what waits."""
        outbox.check_armed = False
        queued = self._queued
        if not queued:
            return
        now = time.monotonic()
        stalled = all(0.0 < w.busy_since <= now - self._stall for w in list(self._running))
        if stalled:
            for _ in range(queued):
                self._start_one()
        if self._queued and not outbox.check_armed:
            outbox.check_armed = True
            outbox.loop.call_later(self._stall, self._check, outbox)

    def _next(self, worker: _Worker) -> _Call | None:
        """The next call in turn, or ``None`` when none waits (the worker is then parked)."""
        with self._lock:
            if not self._turns:
                self._running.remove(worker)
                self._parked.append(worker)
                return None
            turns = self._turns
            lane, queue = turns[0]
            call = queue.popleft()
            if not queue:
                turns.popleft()
                del self._lanes[lane]
            elif len(turns) > 1:
                turns.rotate(-1)  # its next call waits for the other lanes
            self._queued -= 1
            return call

    def _work(self, worker: _Worker) -> None:
        while True:
            if not worker.wake.acquire(timeout=IDLE_SECONDS):
                with self._lock:
                    if worker in self._parked:  # not woken meanwhile: end
                        self._parked.remove(worker)
                        return
                worker.wake.acquire()  # woken just as the wait ran out
            while True:
                call = self._next(worker)
                if call is None:
                    break
                if not call[4].cancelled():  # else its caller gave up before it began
                    worker.busy_since = time.monotonic()
                    _run(call)
                    worker.busy_since = 0.0
                del call  # nothing of it stays alive while the worker is parked


def _run(call: _Call) -> None:
    """Run one call and queue its outcome."""
    function, args, kwargs, context, future, outbox = call
    try:
        value = context.run(function, *args, **kwargs)
    except BaseException as error:  # delivered to the caller, as asyncio.to_thread does
        outbox.put(future, False, error)
    else:
        outbox.put(future, True, value)


_SHARED: WorkerPool | None = None


def shared_pool() -> WorkerPool:
    """The process's pool for sync tools (made on first use, and again in a forked child)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = WorkerPool()
    return _SHARED


def _forget_after_fork() -> None:
    global _SHARED
    _SHARED = None  # the parent's threads do not exist in the child


os.register_at_fork(after_in_child=_forget_after_fork)
