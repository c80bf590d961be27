"""One cell's life: observations, buffering, nested calls, termination (``runtime.md`` §13).

A :class:`Cell` receives the engine's events (items, tool calls, notifications, yields, completion)
in the order the JavaScript produced them and turns them into outcomes for at most one observer at
a time. Content items accumulate until an observation ends; a completion nobody observes is
buffered for the next one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import msgspec

from codemode.errors import CodeModeError
from codemode.protocol.constants import CALLBACK_GRACE, MAX_PENDING_DELEGATE_CALLS
from codemode.protocol.delegation import CallbackFailed, CallbackResult, tool_result_json
from codemode.protocol.identifiers import normalize_identifier
from codemode.protocol.pieces import heavy, put_back, split
from codemode.protocol.strict_json import collector_paused
from codemode.protocol.texts import (
    EXEC_RUNTIME_ENDED_UNEXPECTEDLY,
    TOO_MANY_CALLBACKS,
    notification_not_delivered,
)
from codemode.protocol.types import (
    CellId,
    CodeModeNestedToolCall,
    ContentItem,
    ImageDetail,
    InputAudio,
    InputImage,
    InputText,
    LiveCell,
    Result,
    RuntimeResponse,
    Terminated,
    ToolCallSite,
    ToolDefinition,
    Yielded,
)
from codemode.runtime.engine import THREAD_CHARS, NodeEngine, outside_strings, result_frame
from codemode.session import CancellationToken, cell_context, run_in, serve_callback

if TYPE_CHECKING:
    from codemode.runtime.session import LocalSession

__all__ = ["Cell", "EarlyYield"]

logger = logging.getLogger("codemode.runtime")
#: One DEBUG record when a cell starts and one when it ends (with its duration and outcome).
cells_logger = logging.getLogger("codemode.cells")

#: How long terminate waits for the engine to confirm that the isolate stopped.
STOP_TIMEOUT: Final = 2.0
_DECODER: Final = msgspec.json.Decoder()
#: The most output (characters) a cell may have buffered for its next observer: past it the cell
#: ends with an error that keeps what it buffered. Small enough that the observation fits a V1
#: frame in the common case; the prelude's own bound (64 Mi over a cell's life) is the engine's.
MAX_BUFFERED_OUTPUT_CHARS: Final = 16 * 1024 * 1024
#: The most output (characters, counted as a cell's) all the cells of one session together may
#: have buffered for observers: running, terminating, or completed and not yet observed. A cell's
#: own bound does not bound how many cells keep that much (a cell that yields and is never waited
#: on keeps its buffer, a completion nobody observes keeps its items): 20 such cells of 16 Mi
#: non-BMP characters (4 bytes each in Python) took this process from 27 MiB to 1.3 GiB (now
#: 0.3 GiB). Four cells at their own limit (and what one cell may emit over its life): an agent
#: that waits on its cells never comes near it, and a session holds at most 256 MiB of such text.
#: An item that would pass it is not taken, so that many cells cannot each pass it by one item.
MAX_SESSION_BUFFERED_OUTPUT_CHARS: Final = 64 * 1024 * 1024
#: What a cell's error text may keep however full the session's output is (it counts there too).
MIN_ERROR_TEXT_ROOM: Final = 64 * 1024
#: What each buffered item counts for besides its characters (bounds floods of empty items).
ITEM_OVERHEAD_CHARS: Final = 64
#: The most characters of tool inputs and notification texts a session may have handed to its
#: delegate and not yet seen settled (each one stays in memory until then). As large as one tool
#: input may be (the prelude's bound), so that a lone call of any allowed size still goes out.
MAX_PENDING_INPUT_CHARS: Final = 128 * 1024 * 1024
#: How a call over that bound is refused (the cell sees it as the call's rejection).
PENDING_INPUTS_TOO_LARGE: Final = (
    "tool call refused: the unsettled tool inputs and notifications of this session would "
    f"exceed {MAX_PENDING_INPUT_CHARS} characters"
)
#: The most JSON values (keys included) those unsettled tool inputs may hold. A value costs Python
#: far more than its characters once decoded (an empty object: 3 characters, ≈90 bytes), so the
#: characters alone let one call of `[{},{},…]` take gigabytes.
MAX_PENDING_INPUT_VALUES: Final = 4 * 1024 * 1024
#: The notifications one cell may send (the prelude's bound, checked again here: each costs this
#: process a delegate callback, and a subverted prelude would otherwise send them without end).
MAX_NOTIFICATIONS_PER_CELL: Final = 10_000
NOTIFICATIONS_EXHAUSTED: Final = (
    f"the cell sent more than {MAX_NOTIFICATIONS_PER_CELL} notifications"
)
PENDING_VALUES_TOO_MANY: Final = (
    "tool call refused: the unsettled tool inputs of this session would hold more than "
    f"{MAX_PENDING_INPUT_VALUES} JSON values"
)
#: The most arrays and objects among those values. Each is a Python object the cyclic collector
#: tracks: decoding two million of them (a cell's `[[],[],…]`, or arrays nested 120 deep, within
#: the bound on values), and the collections that then walked them, held the event loop (every
#: session's) for 0.5 to 2.5 s per call, where numbers and strings cost it nothing. Now ≤ 0.2 s.
MAX_PENDING_INPUT_CONTAINERS: Final = 512 * 1024
PENDING_CONTAINERS_TOO_MANY: Final = (
    "tool call refused: the unsettled tool inputs of this session would hold more than "
    f"{MAX_PENDING_INPUT_CONTAINERS} JSON arrays and objects"
)
#: Error texts longer than this are cut (a cell can throw a string of any size). As large as the
#: output one observation may buffer: the upstream host keeps a thrown string of megabytes whole.
MAX_ERROR_TEXT_CHARS: Final = 16 * 1024 * 1024


_FINISHING: set[asyncio.Task[None]] = set()


def _session_output_too_large() -> str:
    # Made when a cell ends on the bound, which is read then (tests lower it).
    return (
        "exec cell output exceeds the session limit of "
        f"{MAX_SESSION_BUFFERED_OUTPUT_CHARS} characters waiting unread in all its cells"
    )


#: A buffered item: its kind and its strings. The cyclic collector stops tracking a tuple that
#: holds only strings, so the million items a session may buffer cost its full collections
#: nothing (held as objects, they cost each full collection about 70 ms, every time a cell's
#: flood of items triggered one).
_Packed: TypeAlias = tuple[str, ...]


def _packed(item: ContentItem) -> _Packed:
    if isinstance(item, InputText):
        return ("text", item.text)
    if isinstance(item, InputImage):
        return ("image", item.image_url, "" if item.detail is None else str(item.detail))
    return ("audio", item.audio_url)


def _unpacked(packed: _Packed) -> ContentItem:
    kind = packed[0]
    if kind == "text":
        return InputText(packed[1])
    if kind == "image":
        return InputImage(packed[1], ImageDetail(packed[2]) if packed[2] else None)
    return InputAudio(packed[1])


def _item_chars(item: _Packed) -> int:
    """What a buffered item counts against the bounds on buffered output (its text, or its
    media's URL)."""
    return ITEM_OVERHEAD_CHARS + len(item[1])


def _json_counts(text: str, value_room: int, container_room: int) -> tuple[int, int]:
    """How many values (keys included) and how many arrays and objects JSON ``text`` holds at
    most. Counted from its separators (C-speed scans, each mark once: a tool input of 50 M
    characters takes about 50 ms a scan on the event loop); only when a count exceeds its room are
    the strings, whose own commas, colons and brackets count too, taken out first."""
    counts = _marks(text)
    if counts[0] > value_room or counts[1] > container_room:
        # Every string is a value: more strings than the room is more values, found without
        # taking them out (which costs an object each: 40 million empty strings, an input the
        # prelude allows, held the event loop every session shares for 4 s and took 1 GiB).
        bare = outside_strings(text, value_room)
        counts = (value_room + 1, 0) if bare is None else _marks(bare)
    return counts


def _marks(text: str) -> tuple[int, int]:
    containers = text.count("[") + text.count("{")
    return 1 + containers + text.count(",") + text.count(":"), containers


def _decoded_input(text: str) -> Any:
    """A tool input, decoded with the cyclic collector paused (a million arrays and objects had it
    walk them again and again: most of the decode's time)."""
    with collector_paused():
        return _DECODER.decode(text)


#: What :func:`_counted_input` gives for an input that is not JSON.
_NOT_JSON: Final = object()


def _counted_input(
    text: str, value_room: int, container_room: int, strings: dict[str, str] | None = None
) -> tuple[tuple[int, int], Any]:
    """A large tool input's counts (:func:`_json_counts`) and, when they are within the rooms,
    its value (:data:`_NOT_JSON`: malformed), on a worker thread: its long strings are decoded a
    piece at a time (:mod:`codemode.protocol.pieces`; ``strings``: they were, and ``text`` holds
    their placeholders), each a C call of its own, and counted as one value each. Decoded whole,
    one of 63 M backslashes (126 M characters of JSON) held the event loop every session shares
    for 0.5 s."""
    skeleton = text
    pieces = None
    if strings is None:
        try:
            pieces = split(text)
        except msgspec.DecodeError:
            return (0, 0), _NOT_JSON
        skeleton = pieces.skeleton
    counts = _json_counts(skeleton, value_room, container_room)
    if counts[0] > value_room or counts[1] > container_room:
        return counts, None
    try:
        if pieces is not None:
            strings = pieces.strings()
        with collector_paused():
            return counts, put_back(_DECODER.decode(skeleton), strings or {})
    except (msgspec.DecodeError, RecursionError):
        return counts, _NOT_JSON


def _log_undelivered(result: CallbackResult) -> None:
    if isinstance(result, CallbackFailed):
        logger.warning("%s", notification_not_delivered(result.message))


def _settle(future: asyncio.Future[RuntimeResponse], response: RuntimeResponse) -> None:
    if not future.done():
        future.set_result(response)


def _spawn(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run a cell's ending in the background (held here: the loop keeps only weak references)."""
    task = asyncio.ensure_future(coroutine)
    _FINISHING.add(task)
    task.add_done_callback(_FINISHING.discard)


class _State(Enum):
    RUNNING = "running"  # the JavaScript runs (or waits)
    FINISHING = "finishing"  # the engine reported an end; callbacks are being settled
    COMPLETED = "completed"  # the completion is ready for (or buffered for) an observer
    TERMINATING = "terminating"
    CLOSED = "closed"


class _Observer:
    __slots__ = ("future", "timer", "yield_ms")

    def __init__(self, future: asyncio.Future[RuntimeResponse], yield_ms: int) -> None:
        self.future = future
        self.yield_ms = yield_ms
        self.timer: asyncio.TimerHandle | None = None


class EarlyYield:
    """Ends one observation early, as its yield timer would; requested before the observation
    attached, it takes effect as soon as it does (and none once the observation ended)."""

    __slots__ = ("_fire", "requested")

    def __init__(self) -> None:
        self.requested = False
        self._fire: Callable[[], None] | None = None

    def request(self) -> None:
        """Yield now (idempotent)."""
        self.requested = True
        if self._fire is not None:
            self._fire()


class Cell:
    """The state machine of one admitted cell of a :class:`LocalSession`."""

    def __init__(
        self,
        session: LocalSession,
        engine: NodeEngine,
        cell_id: CellId,
        call_id: str,
        tools: list[ToolDefinition],
    ) -> None:
        self.cell_id = cell_id
        self.key = 0  # the engine's key, set once the engine runs the cell
        self._session = session
        self._engine = engine
        self._buffered = 0
        self._completed_at = 0  # when the completion became ready (monotonic ns)
        self._loop = asyncio.get_running_loop()
        self._call_id = call_id
        self._tools = tools
        self._state = _State.RUNNING
        self._items: list[_Packed] = []
        self._observer: _Observer | None = None
        self._observed = False
        self._parked_yield = False
        self._handed_out = False  # the completion was delivered; not consumed yet
        self._yield_turn = -1  # the cell's turn of the last yield_control that ended an observation
        self._started = False
        self._error_text: str | None = None
        self._failed_call: ToolCallSite | None = None
        self._calls: dict[str, tuple[asyncio.Future[Any], CancellationToken]] = {}
        self._notifications: dict[asyncio.Future[None], CancellationToken] = {}
        # Every unsettled callback's token (tool calls and notifications) in the order they were
        # issued, with its place in the session's order (Session.revoke_callbacks).
        self._issued: dict[CancellationToken, int] = {}
        self._notify_budget = MAX_NOTIFICATIONS_PER_CELL
        self._stopped = asyncio.Event()
        self._closed_event = asyncio.Event()
        self._began = time.monotonic()
        self._outcome = "closed"
        #: Made in ``execute``: the context its delegate callbacks run in.
        self._context = cell_context()
        if cells_logger.isEnabledFor(logging.DEBUG):
            cells_logger.debug(
                "event=cell-start cell=%s call=%s tools=%d", cell_id, call_id, len(tools)
            )

    @property
    def closed(self) -> bool:
        """True once the cell's terminal outcome was delivered (or it was terminated)."""
        return self._state is _State.CLOSED

    @property
    def concluded(self) -> bool:
        """True once closed, or once its completion is on its way to an observer: a wait or
        terminate that comes now finds no cell (the outcome is given out once)."""
        return self._state is _State.CLOSED or self._handed_out

    # -- observations --------------------------------------------------------------------------

    def attach(
        self, yield_ms: int, early: EarlyYield | None = None
    ) -> Coroutine[Any, Any, RuntimeResponse]:
        """Attach an observation now (a wait that comes later finds it: the cell's initial
        response is its first observer, as on the upstream host); the coroutine returned awaits
        the outcome that ends it (``early`` may end it sooner, through the yield timer's own
        path)."""
        if self._watching() is not None:
            raise CodeModeError(f"exec cell {self.cell_id} already has an active observer")
        observer = _Observer(self._loop.create_future(), yield_ms)
        self._observer = observer
        self._observed = True
        if self._state is _State.COMPLETED:
            self._hand_out()
        elif self._parked_yield:
            self._parked_yield = False
            self._deliver(Yielded(self.cell_id, self._drain()))
        else:
            if self._started:
                self._arm(observer)
            if early is not None:
                early._fire = partial(self._yield_to, observer)
                if early.requested:
                    self._yield_to(observer)
        return self._observation(observer, early)

    async def _observation(self, observer: _Observer, early: EarlyYield | None) -> RuntimeResponse:
        try:
            if observer.future.done() and not isinstance(observer.future.result(), Result):
                # A yield known at once (0 ms): the loop still gets its turn, or a caller that
                # waits 0 ms in a loop would never let the engine's output in. A buffered result
                # is handed out in this step, as upstream does: a wait read together with its
                # cancel is answered the result.
                await asyncio.sleep(0)
            response = await observer.future
        except asyncio.CancelledError:
            if self._observer is observer:
                self._detach()
            elif observer.future.done() and not observer.future.cancelled():
                self._undeliver(observer.future.result())
            raise
        finally:
            if early is not None:
                early._fire = None
        if isinstance(response, Result):
            self._close()
        return response

    def _hand_out(self) -> None:
        """Deliver the completion to the attached observer."""
        self._handed_out = True
        self._deliver(self._completion())

    def _arm(self, observer: _Observer) -> None:
        if observer.yield_ms <= 0:
            # Yield time 0 yields at once (§13.2), before anything the cell does from here on:
            # the upstream host's initial response is then always `Yielded` with what was there.
            self._yield_to(observer)
            return
        if observer.timer is None:
            observer.timer = self._loop.call_later(
                observer.yield_ms / 1000, self._yield_to, observer
            )

    def _watching(self) -> _Observer | None:
        """The attached observer, unless it vanished: its waiter was cancelled (the connection
        ended, say) and has not run yet to detach it. What it would have had stays here."""
        observer = self._observer
        if observer is not None and observer.future.done():
            self._detach()
            return None
        return observer

    def _yield_to(self, observer: _Observer) -> None:
        if self._watching() is observer and self._state is _State.RUNNING:
            self._deliver(Yielded(self.cell_id, self._drain()))

    def _drain(self) -> list[ContentItem]:
        items = [_unpacked(packed) for packed in self._items]
        self._items = []
        self._session.buffered_output -= self._buffered  # the observation takes them: room again
        self._buffered = 0
        return items

    def _deliver(self, response: RuntimeResponse) -> None:
        observer, self._observer = self._observer, None
        if observer is None:
            return
        if observer.timer is not None:
            observer.timer.cancel()
        observer.future.set_result(response)

    def _detach(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None and observer.timer is not None:
            observer.timer.cancel()

    def _undeliver(self, response: RuntimeResponse) -> None:
        # The observer vanished after its outcome was set: its items go back to the front (a
        # completion stays buffered, since the cell only closes once an observer consumed it).
        if self._state is not _State.CLOSED:
            items = [_packed(item) for item in response.content_items]
            self._items[:0] = items
            # Buffered again, so counted again (the cell's own bound and the session's).
            size = sum(map(_item_chars, items))
            self._buffered += size
            self._session.buffered_output += size
            if isinstance(response, Result):
                self._handed_out = False

    def _completion(self) -> Result:
        # How long the completion waited for an observer (0 when one was attached).
        buffered = 0 if self._completed_at == 0 else time.monotonic_ns() - self._completed_at
        return Result(
            self.cell_id,
            self._drain(),
            self._error_text,
            result_buffered_for_ns=buffered,
            failed_call=self._failed_call,
        )

    # -- engine events ---------------------------------------------------------------------------

    def on_started(self) -> None:
        self._started = True
        if self._observer is not None:
            if self._observer.yield_ms <= 0:
                # The observation ends before the cell's first run, which then is one step in
                # the cell's timeline (decision 0004): a yield_control() in it finds no observer.
                self._yield_turn = 0
            self._arm(self._observer)

    def on_item(self, item: ContentItem) -> None:
        # An item the cell made before a termination stopped it is part of its `Terminated`
        # (within the same bounds: an engine that goes on sending cannot grow it further).
        running = self._state is _State.RUNNING
        if not running and (
            self._state is not _State.TERMINATING or self._buffered > MAX_BUFFERED_OUTPUT_CHARS
        ):
            return
        packed = _packed(item)
        size = _item_chars(packed)
        session = self._session
        over = session.buffered_output + size > MAX_SESSION_BUFFERED_OUTPUT_CHARS
        refusal = session.held_refusal(size)
        if over or refusal is not None:
            # The item is not taken (one kept per cell would let 128 cells pass the bound by 16
            # Mi characters each): its cell ends as at its own bound, with what it had buffered;
            # the other cells keep theirs (counted) until observed.
            if running:
                self._engine.terminate(self.key)
                self._end(
                    _session_output_too_large() if over else f"exec cell output exceeds {refusal}"
                )
            return
        self._items.append(packed)
        self._buffered += size
        session.buffered_output += size
        if running and self._buffered > MAX_BUFFERED_OUTPUT_CHARS:
            self._engine.terminate(self.key)
            self._end(
                f"exec cell output exceeds the limit of {MAX_BUFFERED_OUTPUT_CHARS} characters"
            )

    def on_yield(self, turn: int) -> None:
        if self._state is not _State.RUNNING:
            return
        if self._watching() is not None and turn != self._yield_turn:
            self._yield_turn = turn
            self._deliver(Yielded(self.cell_id, self._drain()))
        elif not self._observed:
            self._parked_yield = True
        # Otherwise nobody observed the cell when it yielded — an observer that attached during
        # the same uninterrupted run of the cell came after it, in the cell's timeline: a no-op.

    def on_call(
        self, call_id: str, tool: int, input_json: str | None, strings: dict[str, str] | None = None
    ) -> asyncio.Future[None] | None:
        if self._state is not _State.RUNNING:
            return None
        if call_id in self._calls:
            # Only a subverted prelude repeats a pending id (it makes each anew). Served again,
            # the second would take the first's place here, and the first would never be
            # cancelled when the cell ends (nor its session's slot given back).
            return None
        if not 0 <= tool < len(self._tools):
            self._engine.send_result(self.key, call_id, False, "unknown tool")
            return None
        if self._session.pending_calls >= MAX_PENDING_DELEGATE_CALLS:
            self._engine.send_result(self.key, call_id, False, TOO_MANY_CALLBACKS)
            return None
        # Each unsettled input stays in this process (its text and its decoded value) until its
        # tool answers: with a slow tool, 1,024 large inputs would exhaust the host's memory.
        size = 0 if input_json is None else len(input_json)
        if strings:  # its long strings came decoded: what is held is their characters
            size += sum(map(len, strings.values()))
        if (refusal := self._input_refusal(size)) is not None:
            self._engine.send_result(self.key, call_id, False, refusal)
            return None
        if input_json is None:
            self._admit(call_id, tool, None, counts=(0, 0), rooms=(0, 0))
            return None
        rooms = (
            MAX_PENDING_INPUT_VALUES - self._session.pending_input_values,
            MAX_PENDING_INPUT_CONTAINERS - self._session.pending_input_containers,
        )
        if (size >= THREAD_CHARS or strings) and self._engine.deferrable:
            # Counted and decoded on a worker thread (the engine's later messages wait): each
            # count is a pass of its own over the text, 15-30 ms for 50 M characters, a long
            # string is decoded a piece at a time, and the event loop every session shares runs
            # between them.
            return asyncio.ensure_future(
                self._admit_off_loop(call_id, tool, input_json, rooms, strings=strings, size=size)
            )
        if strings:
            counts, value = _counted_input(input_json, *rooms, strings)
            self._admit(
                call_id, tool, input_json, counts=counts, rooms=rooms, decoded=(value,), size=size
            )
            return None
        self._admit(call_id, tool, input_json, counts=_json_counts(input_json, *rooms), rooms=rooms)
        return None

    async def _admit_off_loop(
        self,
        call_id: str,
        tool: int,
        input_json: str,
        rooms: tuple[int, int],
        *,
        strings: dict[str, str] | None,
        size: int,
    ) -> None:
        counts, value = await asyncio.to_thread(_counted_input, input_json, *rooms, strings)
        if self._state is not _State.RUNNING:
            return  # it ended meanwhile: nobody wants the call
        try:
            self._admit(
                call_id, tool, input_json, counts=counts, rooms=rooms, decoded=(value,), size=size
            )
        except Exception:  # as the engine logs what a handler raises
            logger.exception("codemode engine: failed to handle _Call")

    def _admit(
        self,
        call_id: str,
        tool: int,
        input_json: str | None,
        *,
        counts: tuple[int, int],
        rooms: tuple[int, int],
        decoded: tuple[Any] | None = None,
        size: int | None = None,
    ) -> None:
        """Serve a call whose input has ``counts`` values and containers (at most), within the
        ``rooms`` the session had for them when they were counted (``decoded``: its value, made
        with the counts, :func:`_counted_input`; ``size``: the characters it holds, when not its
        text's)."""
        if size is None:
            size = 0 if input_json is None else len(input_json)
        values, containers = counts
        if values > rooms[0]:
            self._engine.send_result(self.key, call_id, False, PENDING_VALUES_TOO_MANY)
            return
        if containers > rooms[1]:
            self._engine.send_result(self.key, call_id, False, PENDING_CONTAINERS_TOO_MANY)
            return
        try:
            if decoded is not None:
                arguments = decoded[0]
                if arguments is _NOT_JSON:
                    raise msgspec.DecodeError
            else:
                arguments = None if input_json is None else _decoded_input(input_json)
        except (msgspec.DecodeError, RecursionError):  # the prelude bounds depth; the engine
            # is untrusted all the same
            self._engine.send_result(self.key, call_id, False, "tool input is not JSON")
            return
        definition = self._tools[tool]
        token = CancellationToken()
        invocation = CodeModeNestedToolCall(
            self.cell_id, call_id, definition.tool_name, definition.kind, arguments
        )

        call = self._session.delegate.invoke_tool(invocation, token)
        task = serve_callback(
            call, partial(self._settle_call, call_id, token, size), context=self._context
        )
        if task is not None:  # an eagerly started tool may already have answered
            self._calls[call_id] = (task, token)
            self._issue(token)
            self._session.hold_callback(task, size, values, containers)

    def _settle_call(
        self, call_id: str, token: CancellationToken, size: int, result: CallbackResult
    ) -> None:
        self._calls.pop(call_id, None)
        self._issued.pop(token, None)
        if token.is_cancelled() or self._state is not _State.RUNNING:
            return  # nobody wants it any more
        # The session's last outstanding callback (this one counts until its task is done, an
        # eagerly settled one never counted): no other result can share its frame.
        alone = self._session.pending_calls <= 1
        if isinstance(result, CallbackFailed):
            self._engine.send_result(self.key, call_id, False, result.message, alone=alone)
            return
        value = getattr(result, "value", None)
        if heavy(value):
            # Encoded on a worker thread, a piece at a time (a tool that echoes the cell's input
            # gives the cell the size of its result). The call counts against the session's
            # bounds, with its input's characters, until its frame is written: a cell cannot
            # pile up results waiting to be encoded.
            encoding = asyncio.ensure_future(
                asyncio.to_thread(result_frame, self.key, call_id, value)
            )
            self._session.hold_callback(encoding, size)
            encoding.add_done_callback(partial(self._send_result_frame, call_id, token))
            return
        try:
            encoded = tool_result_json(value)
        except CodeModeError as error:
            self._engine.send_result(self.key, call_id, False, error.message, alone=alone)
            return
        self._engine.send_result(self.key, call_id, True, msgspec.Raw(encoded), alone=alone)

    def _send_result_frame(
        self, call_id: str, token: CancellationToken, encoding: asyncio.Future[bytearray]
    ) -> None:
        if encoding.cancelled() or token.is_cancelled() or self._state is not _State.RUNNING:
            return
        error = encoding.exception()
        if isinstance(error, CodeModeError):
            self._engine.send_result(self.key, call_id, False, error.message)
        elif error is not None:
            logger.error("codemode engine: cannot encode a tool result", exc_info=error)
            self._engine.send_result(self.key, call_id, False, str(error) or type(error).__name__)
        else:
            self._engine.send_result_frame(self.key, encoding.result())

    def _input_refusal(self, size: int) -> str | None:
        """Why a tool input or notification text of ``size`` characters may not be held until it
        is settled (``None``: it may)."""
        session = self._session
        if session.pending_input_chars + size > MAX_PENDING_INPUT_CHARS:
            return PENDING_INPUTS_TOO_LARGE
        if (refusal := session.held_refusal(size)) is not None:
            return f"tool call refused: its input would pass {refusal}"
        return None

    def on_notify(self, text: str) -> None:
        if self._state is not _State.RUNNING:
            return
        self._notify_budget -= 1
        if self._notify_budget < 0:
            if self._notify_budget == -1:  # logged once per cell, not once per message
                logger.warning("%s", notification_not_delivered(NOTIFICATIONS_EXHAUSTED))
            return
        if self._session.pending_calls >= MAX_PENDING_DELEGATE_CALLS:
            logger.warning("%s", notification_not_delivered(TOO_MANY_CALLBACKS))
            return
        if (refusal := self._input_refusal(len(text))) is not None:
            logger.warning("%s", notification_not_delivered(refusal))
            return
        token = CancellationToken()
        call = self._session.delegate.notify(self._call_id, self.cell_id, text, token)
        task = serve_callback(call, _log_undelivered, notification=True, context=self._context)
        if task is not None:
            self._notifications[task] = token
            self._issue(token)
            self._session.hold_callback(task, len(text))
            task.add_done_callback(self._notification_done)

    def _notification_done(self, task: asyncio.Future[None]) -> None:
        token = self._notifications.pop(task, None)
        if token is not None:
            self._issued.pop(token, None)

    def _issue(self, token: CancellationToken) -> None:
        self._session.callbacks_issued += 1
        self._issued[token] = self._session.callbacks_issued

    @property
    def issued(self) -> dict[CancellationToken, int]:
        """The tokens of the cell's unsettled callbacks, each with its place in the order the
        session issued callbacks (read-only)."""
        return self._issued

    def on_done(
        self,
        error: str | None,
        writes: list[tuple[str, str]],
        call: tuple[int, int, int] | None,
    ) -> None:
        # The engine host cuts a longer text the same way before sending it (room for its note).
        if error is not None and len(error) > MAX_ERROR_TEXT_CHARS + 64:
            error = (
                error[:MAX_ERROR_TEXT_CHARS]
                + f"\n… (error text cut: {len(error)} characters in all)"
            )
        if self._state is _State.RUNNING:
            if error is not None and call is not None and 0 <= call[0] < len(self._tools):
                identifier = normalize_identifier(self._tools[call[0]].name)
                self._failed_call = ToolCallSite(identifier, call[1], call[2])
            self._state = _State.FINISHING
            _spawn(self._finish(error, writes, natural=True))

    def on_exited(self, reason: str, detail: str | None) -> None:
        self._stopped.set()
        if self._state is not _State.RUNNING:
            return
        limit = self._session.limits.max_heap_size_bytes
        if reason == "oom" and limit is not None:
            message = f"exec cell exceeded the heap limit of {limit} bytes"
        elif reason in ("oom", "memory"):
            cap = self._engine.memory_cap_bytes
            message = f"exec cell exceeded the engine memory limit of {cap} bytes"
        elif reason == "host-memory" and (resident := self._engine.resident) is not None:
            message = (
                f"exec cell exceeded the memory limit of {resident.limit} bytes shared by all "
                "engine processes (its engine grew the most)"
            )
        else:
            if detail:
                logger.warning("exec cell %s: engine failure: %s", self.cell_id, detail)
            message = EXEC_RUNTIME_ENDED_UNEXPECTEDLY
        self._end(message)

    def _end(self, message: str) -> None:
        """Ends the running cell with ``message`` as an error (not a natural completion)."""
        self._state = _State.FINISHING
        _spawn(self._finish(message, [], natural=False))

    # -- ends ------------------------------------------------------------------------------------

    def _counted_error(self, error: str) -> str:
        """``error``, held until observed, counted as buffered output: cut to the room the
        session has left (never below :data:`MIN_ERROR_TEXT_ROOM`), or many cells ending
        unobserved with long errors would pass the session's bound."""
        session = self._session
        room = max(
            MIN_ERROR_TEXT_ROOM,
            min(
                MAX_SESSION_BUFFERED_OUTPUT_CHARS - session.buffered_output,
                session.held_room(),
            ),
        )
        if len(error) > room:
            error = error[:room] + f"\n… (error text cut: {len(error)} characters in all)"
        self._buffered += len(error)
        session.buffered_output += len(error)
        return error

    async def _finish(
        self, error: str | None, writes: list[tuple[str, str]], natural: bool
    ) -> None:
        """Natural-completion order (§13.7); a termination that wins the race stops it."""
        if natural and self._notifications:
            await asyncio.wait(list(self._notifications))
        await self._settle_calls()
        if self._state is not _State.FINISHING:
            return  # a termination won the race: the completion is discarded
        if natural:
            refused = await self._session.commit(writes, self._finishing, (self._engine, self.key))
            if not self._finishing():
                return  # terminated while the writes were merged: discarded with the completion
            if refused is not None and error is None:
                error = refused
        self._error_text = None if error is None else self._counted_error(error)
        self._outcome = "completed" if error is None else "failed"
        self._state = _State.COMPLETED
        if self._watching() is not None:
            self._hand_out()  # nobody waited for it: buffered 0
        else:
            self._completed_at = time.monotonic_ns()

    def _finishing(self) -> bool:
        return self._state is _State.FINISHING

    async def _settle_calls(self) -> None:
        tasks = [task for task, _ in self._calls.values() if not task.done()]
        tasks += [task for task in self._notifications if not task.done()]
        # Newest first, tool calls and notifications alike, as the upstream host revokes a
        # cell's callbacks (delegate/cancel).
        for token in reversed(list(self._issued)):
            token.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CALLBACK_GRACE)

    def terminate(self) -> Awaitable[LiveCell]:
        """Stop the cell (§13.6): a buffered natural completion wins over termination. The state
        changes in this call, so that of two terminates made in one turn the second is refused
        as the spec says; the awaitable finishes the stop."""
        if self._state is _State.COMPLETED:
            completion = self._completion()
            self._close()
            done: asyncio.Future[LiveCell] = self._loop.create_future()
            done.set_result(LiveCell(completion))
            return done
        if self._state is _State.TERMINATING:
            raise CodeModeError(f"exec cell {self.cell_id} is already terminating")
        if self._state is _State.CLOSED:
            raise CodeModeError(f"exec cell {self.cell_id} is closed")
        self._state = _State.TERMINATING
        self._engine.terminate(self.key)
        return self._stop()

    async def _stop(self) -> LiveCell:
        await self._settle_calls()
        if not self._stopped.is_set():
            try:
                await asyncio.wait_for(self._stopped.wait(), STOP_TIMEOUT)
            except TimeoutError:
                logger.warning("exec cell %s: the engine did not confirm the stop", self.cell_id)
        response = Terminated(self.cell_id, self._drain())
        self._outcome = "terminated"
        observer, self._observer = self._observer, None
        self._close()
        if observer is not None:
            # The attached observer learns of the termination two loop turns after the terminate
            # returns (the terminate's caller, behind a shield, wakes in the second), so the
            # terminate is answered first, as the upstream host answers (checked with a `wait`
            # attached, whose host task awaits the observation directly).
            if observer.timer is not None:
                observer.timer.cancel()
            self._loop.call_soon(self._loop.call_soon, _settle, observer.future, response)
        return LiveCell(response)

    async def wait_closed(self) -> None:
        """Return once the cell is closed."""
        await self._closed_event.wait()

    @property
    def terminating(self) -> bool:
        """True while a termination is cleaning up."""
        return self._state is _State.TERMINATING

    def _close(self) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        # Writes the engine still holds for it (its end was not committed): forgotten there.
        self._engine.drop_writes(self.key)
        # Every path here drained the items already; whatever is left gives its room back too.
        self._items = []
        self._session.buffered_output -= self._buffered
        self._buffered = 0
        self._closed_event.set()
        if cells_logger.isEnabledFor(logging.DEBUG):
            cells_logger.debug(
                "event=cell-end cell=%s seconds=%.3f outcome=%s",
                self.cell_id,
                time.monotonic() - self._began,
                self._outcome,
            )
        self._session.forget(self)
        try:
            run_in(self._context, partial(self._session.delegate.cell_closed, self.cell_id))
        except Exception:
            logger.exception("cell_closed(%s) failed", self.cell_id)
