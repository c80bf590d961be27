"""The transport-neutral session API (``protocol-v1.md`` §1.5-§1.8).

Every carrier (the embedded runtime, Protocol V1 over stdio or WebSocket, gRPC) implements
:class:`CodeModeSession`; callers serve tool calls through a :class:`CodeModeSessionDelegate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from abc import ABC, abstractmethod
from asyncio.tasks import _enter_task, _leave_task
from collections.abc import Awaitable, Callable, Coroutine, Generator
from functools import partial
from types import CoroutineType
from typing import Any, Final, cast

from codemode.errors import CodeModeError
from codemode.protocol.delegation import (
    CallbackFailed,
    CallbackResult,
    NotificationAccepted,
    ToolReturned,
    callback_failure,
)
from codemode.protocol.texts import (
    DELEGATE_TASK_CANCELLED,
    EXEC_RUNTIME_ENDED_UNEXPECTEDLY,
    NESTED_TOOLS_UNAVAILABLE,
    PROVIDER_DOES_NOT_SUPPORT_LIMITS,
)
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    ExecuteRequest,
    RuntimeResponse,
    WaitOutcome,
    WaitRequest,
)

__all__ = [
    "EARLY_YIELD_UNSUPPORTED",
    "CancellationToken",
    "CodeModeSession",
    "CodeModeSessionDelegate",
    "CodeModeSessionProvider",
    "NoopCodeModeSessionDelegate",
    "StartedCell",
    "cell_context",
    "current_cell",
    "run_in",
    "serve_callback",
    "start_eagerly",
]

# A delegate that answers without suspending is settled in the iteration that asked it (no
# scheduling, no wake-up), with a real current task: 3.12+ eager tasks, or _start_eagerly.
_EAGER_TASK_FACTORY: Final = getattr(asyncio, "eager_task_factory", None)


class CancellationToken:
    """A one-way signal that a callback's result is no longer wanted.

    Setting it never cancels the delegate's task; the delegate observes it and stops promptly.
    """

    __slots__ = ("_callbacks", "_cancelled", "_event")

    def __init__(self) -> None:
        self._cancelled = False
        self._event: asyncio.Event | None = None
        self._callbacks: list[Callable[[], object]] = []

    def cancel(self) -> None:
        """Signal cancellation (idempotent)."""
        if self._cancelled:
            return
        self._cancelled = True
        if self._event is not None:
            self._event.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def is_cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self._cancelled

    async def wait_cancelled(self) -> None:
        """Return once the token is cancelled."""
        if self._cancelled:
            return
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()

    def add_callback(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` on cancellation (at once if already cancelled)."""
        if self._cancelled:
            callback()
        else:
            self._callbacks.append(callback)


class CodeModeSessionDelegate:
    """Client-side callbacks for one session: nested tool calls, notifications, cell close.

    The base class behaves like :class:`NoopCodeModeSessionDelegate`; override what you serve.
    """

    def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> Awaitable[JSON]:
        """Run a nested tool; the returned JSON resolves the JavaScript promise.

        Usually an ``async def``. Raising :class:`CodeModeError` rejects the promise with its
        message. An override may also return an :class:`asyncio.Future` (say, one a dispatcher
        of its own resolves): it is settled from its done callback, with no task per call.
        """
        return _unavailable(cancellation)

    def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> Awaitable[None]:
        """Deliver a ``notify(...)`` text; ``call_id`` is the execute's ``tool_call_id``.
        Usually an ``async def``; like :meth:`invoke_tool`, may return a future."""
        return _accepted()

    def cell_closed(self, cell_id: CellId) -> None:
        """Release state held for ``cell_id``; called once per admitted cell. Must not block."""
        return


async def _unavailable(cancellation: CancellationToken) -> JSON:
    await cancellation.wait_cancelled()
    raise CodeModeError(NESTED_TOOLS_UNAVAILABLE)


async def _accepted() -> None:
    return


class NoopCodeModeSessionDelegate(CodeModeSessionDelegate):
    """A delegate with no tools: calls wait for cancellation, then fail."""


#: What :meth:`StartedCell.yield_early` raises where the carrier cannot end an observation early.
EARLY_YIELD_UNSUPPORTED: Final = (
    "this code-mode session cannot end an observation early (no early yield on its carrier)"
)


class StartedCell:
    """An admitted cell: its id now, its first outcome later (two-phase execute, §1.6).

    ``initial_response()`` may be awaited once. Dropping the cell, cancelling the awaiting task or
    calling :meth:`cancel` abandons it, which makes the implementation terminate the cell.
    :meth:`yield_early` ends the initial observation early without stopping the cell.
    """

    __slots__ = ("_abandon", "_consumed", "_done", "_future", "_yield_early", "cell_id")

    def __init__(
        self,
        cell_id: CellId,
        future: asyncio.Future[RuntimeResponse],
        abandon: Callable[[], object] | None = None,
        *,
        yield_early: Callable[[], object] | None = None,
    ) -> None:
        self.cell_id = cell_id
        self._future = future
        self._abandon = abandon
        self._yield_early = yield_early
        self._consumed = False
        self._done = False

    @classmethod
    def from_awaitable(
        cls,
        cell_id: CellId,
        awaitable: Awaitable[RuntimeResponse],
        abandon: Callable[[], object] | None = None,
        *,
        yield_early: Callable[[], object] | None = None,
    ) -> StartedCell:
        """Wrap the producer of the initial response; ``abandon`` cleans up an abandoned cell;
        ``yield_early`` (where the carrier can) ends the initial observation early, also when
        called before the producer attached it."""
        return cls(cell_id, asyncio.ensure_future(awaitable), abandon, yield_early=yield_early)

    async def initial_response(self) -> RuntimeResponse:
        """Await the cell's first outcome (yield, completion or termination)."""
        if self._consumed:
            raise RuntimeError("StartedCell.initial_response() may only be awaited once")
        self._consumed = True
        future = self._future
        try:
            await asyncio.wait((future,))
        except asyncio.CancelledError:
            self._consumed_abandon()
            raise
        self._done = True
        self._abandon = None
        if future.cancelled():
            raise CodeModeError(EXEC_RUNTIME_ENDED_UNEXPECTEDLY)
        return future.result()

    def yield_early(self) -> None:
        """End the initial observation now, as its yield timer would, without stopping the cell.

        ``initial_response()`` then returns ``Yielded`` with the items so far (or the completion or
        termination, if that already happened); later waits see what follows. Callable before
        ``initial_response()`` is awaited; a no-op once it was delivered or the cell abandoned.
        Where the carrier cannot do it (Protocol V1) it raises :class:`CodeModeError` every time.
        """
        if self._yield_early is None:
            raise CodeModeError(EARLY_YIELD_UNSUPPORTED)
        if not self._done:
            self._yield_early()

    def cancel(self) -> None:
        """Abandon the cell (idempotent; no effect once the initial response was delivered)."""
        if self._done:
            return
        self._consumed_abandon()

    def _consumed_abandon(self) -> None:
        self._done = True
        abandon, self._abandon = self._abandon, None
        if not self._future.done():
            self._future.cancel()
        elif not self._future.cancelled():
            self._future.exception()  # mark retrieved: an abandoned cell's error is not news
        if abandon is not None:
            abandon()

    def __del__(self) -> None:
        if not self._done and self._abandon is not None:
            with contextlib.suppress(Exception):
                self._consumed_abandon()

    def __repr__(self) -> str:
        return f"StartedCell(cell_id={self.cell_id!r})"


class CodeModeSession(ABC):
    """A durable session: cells share stored values; separate sessions are isolated."""

    @abstractmethod
    async def execute(self, request: ExecuteRequest) -> StartedCell:
        """Admit a cell and return at once; its first outcome is ``initial_response()``."""

    @abstractmethod
    async def wait(
        self, request: WaitRequest, *, early_yield: asyncio.Event | None = None
    ) -> WaitOutcome:
        """Observe a cell for up to ``request.yield_time_ms``. Once ``early_yield`` is set
        (already set: at once), the observation ends early with what the cell produced so far,
        without stopping it; a carrier that cannot do that raises
        :data:`EARLY_YIELD_UNSUPPORTED` for an event set before the wait, and lets the wait run
        its course for one set later."""

    @abstractmethod
    async def terminate(self, cell_id: CellId) -> WaitOutcome:
        """Stop a cell and return its final outcome."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Terminate every cell and close the session (idempotent)."""

    def is_alive(self) -> bool:
        """False once a remote session's connection has failed; it never comes back."""
        return True

    async def __aenter__(self) -> CodeModeSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()


class CodeModeSessionProvider(ABC):
    """Creates sessions (embedded, or on a remote host)."""

    def availability(self) -> None:
        """Raise :class:`CodeModeError` if this provider cannot create sessions."""
        return

    @abstractmethod
    async def create_session(self, delegate: CodeModeSessionDelegate) -> CodeModeSession:
        """Open a session served by ``delegate``."""

    async def create_session_with_limits(
        self,
        delegate: CodeModeSessionDelegate,
        limits: CodeModeSessionCellExecutionLimits,
    ) -> CodeModeSession:
        """Open a session whose cells share ``limits``."""
        if limits.is_default:
            return await self.create_session(delegate)
        raise CodeModeError(PROVIDER_DOES_NOT_SUPPORT_LIMITS)

    async def aclose(self) -> None:
        """Release what the provider holds (engines, host processes, connections)."""
        return


def serve_callback(
    call: Awaitable[Any],
    settle: Callable[[CallbackResult], object],
    *,
    notification: bool = False,
    context: contextvars.Context | None = None,
) -> asyncio.Future[Any] | None:
    """Run one delegate callback (``invoke_tool`` or ``notify``) and ``settle`` its result once.

    Every carrier serves callbacks through here, so a delegate fails the same way everywhere:
    its own text for a :class:`CodeModeError`, the D4 text for any other exception, the cancelled
    text if its task is cancelled. The callback runs in a copy of ``context`` (its cell's: see
    :func:`cell_context`), else of the current one. Returns what to cancel while it runs — its
    task, or the future the delegate returned — or ``None`` when the callback already finished
    (where the loop starts tasks eagerly).
    """
    context = contextvars.copy_context() if context is None else context.copy()
    if type(call) is not CoroutineType and asyncio.isfuture(call):
        # Nothing to run: the future's owner resolves it (the V1 host's delegate, whose calls
        # are the client's to answer). No task, no coroutine per call.
        call.add_done_callback(partial(_settle_future, settle, notification), context=context)
        return call
    return start_eagerly(_serve(call, settle, notification), context)


def start_eagerly(
    coroutine: Coroutine[Any, Any, None], context: contextvars.Context | None = None
) -> asyncio.Task[None] | None:
    """Run ``coroutine``'s first step now, as the task that drives the rest (in a copy of the
    current context unless ``context`` is given); ``None`` when it finished in that step (what
    it raised, other than a cancellation, is the loop's to report, as for any task)."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context() if context is None else context
    if _EAGER_TASK_FACTORY is not None:
        task: asyncio.Task[None] = _EAGER_TASK_FACTORY(loop, coroutine, context=context)
        return None if task.done() else task
    return _start_eagerly(loop, coroutine, context)


def cell_context() -> contextvars.Context:
    """The context a cell's delegate callbacks run in: that of the ``execute`` that started it.

    Every carrier takes it when ``execute`` is called, so a tool (and ``notify``,
    ``cell_closed``) sees the context variables of the code that ran the cell — a request's user,
    its trace span — never those of whoever happened to start the engine or the connection. It
    also names the cell: :func:`current_cell` is the same object in every callback of the cell.
    """
    context = contextvars.copy_context()
    context.run(_CELL.set, object())
    return context


_CELL: Final[contextvars.ContextVar[object | None]] = contextvars.ContextVar(
    "codemode_cell", default=None
)


def current_cell() -> object | None:
    """An object that stands for the cell whose callback runs (the same in all its callbacks, on
    every carrier, and distinct between any two cells); ``None`` outside a cell's callback."""
    return _CELL.get()


def run_in(context: contextvars.Context | None, function: Callable[[], object]) -> None:
    """Call ``function`` in a copy of ``context`` (the current context when ``None``)."""
    if context is None:
        function()
    else:
        context.copy().run(function)


class _FirstStep:
    """A coroutine whose first step already ran; :meth:`drive` continues it inside a Task."""

    __slots__ = ("coroutine", "error", "finished", "yielded")

    def __init__(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self.coroutine = coroutine
        self.finished = False
        self.error: BaseException | None = None
        self.yielded: Any = None

    def run(self) -> None:
        try:
            self.yielded = self.coroutine.send(None)
        except StopIteration:
            self.finished = True
        except BaseException as error:
            self.finished, self.error = True, error

    def drive(self) -> Generator[Any, Any, None]:
        """The Task's coroutine. Started (primed) before the Task first runs, so that even an
        exception the Task throws in at its first step (a cancellation) reaches the callback."""
        coroutine = self.coroutine
        try:
            yield _PRIMED  # the Task's first step resumes here
        except BaseException as error:
            if self.finished:
                raise
            yielded = None
            thrown: BaseException | None = error
        else:
            if self.finished:
                if self.error is not None:
                    raise self.error
                return
            yielded, thrown = self.yielded, None
        while True:
            if thrown is not None:  # what the Task threw in goes on to the callback
                forwarded, thrown = thrown, None
                try:
                    yielded = coroutine.throw(forwarded)
                except StopIteration:
                    return
            try:
                sent = yield yielded
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as raised:
                thrown = raised
                continue
            try:
                yielded = coroutine.send(sent)
            except StopIteration:
                return


_PRIMED: Final = object()


def _start_eagerly(
    loop: asyncio.AbstractEventLoop,
    coroutine: Coroutine[Any, Any, None],
    context: contextvars.Context,
) -> asyncio.Task[None] | None:
    """Python 3.11's stand-in for 3.12's eager tasks: the first step runs now, *as* the task
    that will drive the rest (so ``asyncio.current_task()``, and every timeout or cancel scope
    entered in that step, belong to it), in that task's context. The task's own first step,
    scheduled as usual, then only picks up where this one stopped."""
    step = _FirstStep(coroutine)
    driver = step.drive()
    task = loop.create_task(cast(Coroutine[Any, Any, None], driver), context=context)
    outer = asyncio.current_task(loop)
    if outer is not None:
        _leave_task(loop, outer)
    _enter_task(loop, task)
    try:
        context.run(step.run)
    finally:
        _leave_task(loop, task)
        if outer is not None:
            _enter_task(loop, outer)
    next(driver)  # to its first yield, before the Task's first step
    return None if step.finished else task


def _settle_future(
    settle: Callable[[CallbackResult], object], notification: bool, future: asyncio.Future[Any]
) -> None:
    if future.cancelled():
        settle(CallbackFailed(DELEGATE_TASK_CANCELLED))
    elif (error := future.exception()) is not None:
        settle(callback_failure(error))
    else:
        settle(NotificationAccepted() if notification else ToolReturned(future.result()))


async def _serve(
    call: Awaitable[Any], settle: Callable[[CallbackResult], object], notification: bool
) -> None:
    try:
        value = await call
    except asyncio.CancelledError:
        settle(CallbackFailed(DELEGATE_TASK_CANCELLED))
        raise
    except BaseException as error:
        settle(callback_failure(error))
        if not isinstance(error, Exception):
            raise
        return
    settle(NotificationAccepted() if notification else ToolReturned(value))
