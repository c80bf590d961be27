"""A deterministic :class:`ClientProtocol` ⇄ :class:`HostProtocol` pair, in the spirit of h11's
``ConnectionPair``: no sockets, no event loop.

:class:`Pair` moves each machine's ``data_to_send()`` into the other's ``receive_data`` (a byte
stream) or ``receive_frame`` (a WebSocket message per frame, on a dual connection), keeping every
frame's lane. It can hold one lane back (so that control and bulk overtake each other as on two
WebSockets), rewrite or drop messages in transit, and inject raw bytes or crafted messages into
either side.

It also plays the two roles around the machines: the *runtime* on the host side (every host event
is answered through the host machine's API, unless the test asked to handle that kind of event
itself) and the *delegate* on the client side (callbacks are run at once and finished).

Every text that comes out of a machine is recorded in a :class:`Recorder`: operation failures,
connection-end reasons, ``failure`` attributes, callback failures, error messages inside frames,
handshake reject reasons and the messages of errors the machines raise.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

from codemode.errors import CodeModeError
from codemode.protocol.constants import (
    DUAL_WEBSOCKET_CAPABILITY,
    SESSION_RESOURCE_LIMITS_CAPABILITY,
)
from codemode.protocol.delegation import (
    CallbackFailed,
    CallbackResult,
    NotificationAccepted,
    ToolReturned,
)
from codemode.protocol.texts import DELEGATE_TASK_CANCELLED
from codemode.protocol.types import (
    CellId,
    InputText,
    LiveCell,
    MissingCell,
    Result,
    RuntimeResponse,
    Terminated,
    Yielded,
)
from codemode.protocol.v1 import events as ev
from codemode.protocol.v1 import messages as wire
from codemode.protocol.v1.client import ClientProtocol
from codemode.protocol.v1.codec import MessageDecoder, decode_framed, encode_frame
from codemode.protocol.v1.host import HostProtocol
from codemode.protocol.v1.lanes import Lane

__all__ = [
    "BULK_TOKEN",
    "Pair",
    "Recorder",
    "Side",
]

#: The bulk connection token every pair's host hands out.
BULK_TOKEN: Final = "bulk-token"

Side = Literal["client", "host"]
E = TypeVar("E", bound=BaseException)
T = TypeVar("T")

_TO_HOST: Final = MessageDecoder[wire.ClientToHost](wire.ClientToHost)


@dataclass(slots=True)
class Recorder:
    """Every text the machines of one or more pairs produced, in order."""

    texts: list[str] = field(default_factory=list)

    def add(self, text: str | None) -> None:
        if text is not None:
            self.texts.append(text)

    def seen(self) -> set[str]:
        return set(self.texts)


def _wire_error_texts(message: wire.ClientToHost | wire.HostToClient) -> list[str]:
    """The exact texts a frame carries: error results and handshake reject reasons."""
    if isinstance(
        message,
        wire.OperationResponse | wire.ExecuteInitialResponse | wire.DelegateResponseMessage,
    ) and isinstance(message.result, wire.WireError):
        return [message.result.message]
    if isinstance(message, wire.ConnectionRejected) and isinstance(
        message.reason, wire.InvalidHello
    ):
        return [message.reason.message]
    return []


class Pair:
    """A client machine wired to a host machine (see the module docstring).

    ``dual`` asks for (and grants) a dual-WebSocket connection. With ``websocket`` (the default
    for a dual connection) each frame travels as one WebSocket message on its lane; otherwise it is
    written to the byte stream of its lane, cut into pieces of ``chunk`` bytes when given. The
    handshake runs at construction unless ``connect=False``.

    Host events whose type is in ``manual_host`` (client events in ``manual_client``) are not
    answered by the pair but collected in :attr:`host_inbox` (:attr:`client_inbox`) for the test.
    """

    def __init__(
        self,
        recorder: Recorder | None = None,
        *,
        dual: bool = False,
        client: ClientProtocol | None = None,
        host: HostProtocol | None = None,
        connect: bool = True,
        websocket: bool | None = None,
        chunk: int | None = None,
        auto_bulk: bool = True,
        manual_host: Iterable[type[ev.HostEvent]] = (),
        manual_client: Iterable[type[ev.ClientEvent]] = (),
    ) -> None:
        self.recorder = recorder if recorder is not None else Recorder()
        capabilities = [SESSION_RESOURCE_LIMITS_CAPABILITY]
        if dual:
            capabilities.append(DUAL_WEBSOCKET_CAPABILITY)
        self.client = client if client is not None else ClientProtocol(dual_websocket=dual)
        self.host = (
            host
            if host is not None
            else HostProtocol(capabilities=capabilities, new_token=lambda: BULK_TOKEN)
        )
        self.websocket = dual if websocket is None else websocket
        self.chunk = chunk
        self.auto_bulk = auto_bulk
        self.manual_host: set[type[ev.HostEvent]] = set(manual_host)
        self.manual_client: set[type[ev.ClientEvent]] = set(manual_client)
        self._to_client: Final = MessageDecoder[wire.HostToClient](
            wire.HostToClient, self.host.wire_revision
        )

        #: Every event each side produced, in order.
        self.client_events: list[ev.ClientEvent] = []
        self.host_events: list[ev.HostEvent] = []
        #: Events left for the test to handle (see ``manual_host`` / ``manual_client``).
        self.host_inbox: list[ev.HostEvent] = []
        self.client_inbox: list[ev.ClientEvent] = []
        #: Every message that reached each side through the pair, with its lane.
        self.to_host: list[tuple[wire.ClientToHost, Lane]] = []
        self.to_client: list[tuple[wire.HostToClient, Lane]] = []
        #: Rewrite (or drop, by returning ``None``) messages in transit.
        self.rewrite_to_host: Callable[[wire.ClientToHost], wire.ClientToHost | None] | None = None
        self.rewrite_to_client: Callable[[wire.HostToClient], wire.HostToClient | None] | None = (
            None
        )

        # The fake runtime: live cells by session, and how callbacks ended.
        self._cell_numbers = itertools.count(1)
        self.live: dict[str, set[str]] = {}
        self.resolved: dict[int, CallbackResult] = {}
        #: What the delegate answers a callback with.
        self.tool_result: Callable[[ev.ToolCallback], CallbackResult] = lambda callback: (
            ToolReturned({"echo": callback.invocation.input})
        )
        self.notification_result: Callable[[ev.NotificationCallback], CallbackResult] = lambda _: (
            NotificationAccepted()
        )

        self._held: dict[tuple[Side, Lane], list[bytes | bytearray]] = {}
        self._holding: set[tuple[Side, Lane]] = set()
        if connect:
            self.run()
            assert self.client.handshaken, self.client.failure
            assert self.host.negotiated is not None

    # -- transit ----------------------------------------------------------------------------------

    def run(self, max_rounds: int = 10_000) -> None:
        """Move frames and answer events until nothing happens any more."""
        for _ in range(max_rounds):
            moved = self._pump_client()
            moved = self._pump_host() or moved
            if not moved:
                self._record_failures()
                return
        raise AssertionError("the pair did not settle")

    def hold(self, lane: Lane, *, to: Side) -> None:
        """Keep frames for ``to`` on ``lane`` back until :meth:`release`."""
        self._holding.add((to, lane))

    def release(self, lane: Lane, *, to: Side, count: int | None = None) -> None:
        """Deliver the frames held for ``to`` on ``lane``, in order, and run; with ``count`` only
        that many, and the lane stays held."""
        held = self._held.setdefault((to, lane), [])
        if count is None:
            self._holding.discard((to, lane))
            count = len(held)
        frames, held[:count] = held[:count], []
        for frame in frames:
            self._deliver(to, frame, lane)
        self.run()

    def inject_bytes(self, to: Side, data: bytes | bytearray, lane: Lane = Lane.CONTROL) -> None:
        """Raw bytes arrive at ``to`` (as a WebSocket message on a dual connection)."""
        endpoint = self._endpoint(to)
        if self.websocket:
            endpoint.receive_frame(data, lane)
        else:
            endpoint.receive_data(data, lane)
        self.run()

    def inject(
        self, to: Side, message: wire.ClientToHost | wire.HostToClient, lane: Lane = Lane.CONTROL
    ) -> None:
        """A crafted message arrives at ``to`` on ``lane``."""
        self.inject_bytes(to, encode_frame(message), lane)

    def eof(self, to: Side, lane: Lane = Lane.CONTROL) -> None:
        """The stream towards ``to`` ends."""
        self._endpoint(to).receive_eof(lane)
        self.run()

    def raises(self, error: type[E], call: Callable[..., object], *args: Any) -> E:
        """Call a machine method that must raise ``error``; its message is recorded."""
        try:
            call(*args)
        except error as raised:
            if isinstance(raised, CodeModeError):
                self.recorder.add(raised.message)
            self.run()
            return raised
        raise AssertionError(f"{call!r} did not raise {error.__name__}")

    def _endpoint(self, side: Side) -> ClientProtocol | HostProtocol:
        return self.client if side == "client" else self.host

    def _pump_client(self) -> bool:
        events = self.client.events_received()
        for event in events:
            self._client_event(event)
        frames = self.client.data_to_send()
        for frame, lane in frames:
            self._record_frame(decode_framed(frame, _TO_HOST))
            self._send("host", frame, lane)
        return bool(events or frames)

    def _pump_host(self) -> bool:
        events = self.host.events_received()
        for event in events:
            self._host_event(event)
        frames = self.host.data_to_send()
        for frame, lane in frames:
            self._record_frame(decode_framed(frame, self._to_client))
            self._send("client", frame, lane)
        return bool(events or frames)

    def _record_frame(self, message: wire.ClientToHost | wire.HostToClient) -> None:
        for text in _wire_error_texts(message):
            self.recorder.add(text)

    def _send(self, to: Side, frame: bytes | bytearray, lane: Lane) -> None:
        if (to, lane) in self._holding:
            self._held.setdefault((to, lane), []).append(frame)
        else:
            self._deliver(to, frame, lane)

    def _deliver(self, to: Side, frame: bytes | bytearray, lane: Lane) -> None:
        if to == "host":
            request = decode_framed(frame, _TO_HOST)
            if self.rewrite_to_host is not None:
                rewritten = self.rewrite_to_host(request)
                if rewritten is None:
                    return
                request, frame = rewritten, encode_frame(rewritten)
            self.to_host.append((request, lane))
        else:
            answer = decode_framed(frame, self._to_client)
            if self.rewrite_to_client is not None:
                changed = self.rewrite_to_client(answer)
                if changed is None:
                    return
                answer, frame = changed, encode_frame(changed)
            self.to_client.append((answer, lane))
        endpoint = self._endpoint(to)
        if self.websocket:
            endpoint.receive_frame(frame, lane)
        elif self.chunk is None:
            endpoint.receive_data(frame, lane)
        else:
            for start in range(0, len(frame), self.chunk):
                endpoint.receive_data(frame[start : start + self.chunk], lane)

    def _record_failures(self) -> None:
        self.recorder.add(self.client.failure)
        self.recorder.add(self.host.failure)

    # -- the delegate (client side) -----------------------------------------------------------------

    def _client_event(self, event: ev.ClientEvent) -> None:
        self.client_events.append(event)
        if isinstance(event, ev.OperationFailed):
            self.recorder.add(event.message)
        elif isinstance(event, ev.ConnectionEnded):
            self.recorder.add(event.reason)
        if type(event) in self.manual_client:
            self.client_inbox.append(event)
            return
        if isinstance(event, ev.HandshakeComplete):
            if event.negotiated.dual_websocket and self.auto_bulk:
                self.client.bulk_opened()
        elif isinstance(event, ev.CallbackRequested):
            self.finish(event)
        elif isinstance(event, ev.CallbackCancelled):
            # The delegate's task notices its cancellation token and ends.
            self.client.finish_callback(event.delegate_id, CallbackFailed(DELEGATE_TASK_CANCELLED))

    def finish(self, event: ev.CallbackRequested, result: CallbackResult | None = None) -> None:
        """The delegate's task for ``event`` ends with ``result`` (default: the pair's answer)."""
        if result is None:
            callback = event.callback
            if isinstance(callback, ev.ToolCallback):
                result = self.tool_result(callback)
            else:
                result = self.notification_result(callback)
        self.client.finish_callback(event.delegate_id, result)

    # -- the runtime (host side) --------------------------------------------------------------------

    def _host_event(self, event: ev.HostEvent) -> None:
        self.host_events.append(event)
        if isinstance(event, ev.ConnectionEnded):
            self.recorder.add(event.reason)
        elif isinstance(event, ev.CallbackResolved):
            self.resolved[event.delegate_id] = event.result
            if isinstance(event.result, CallbackFailed):
                self.recorder.add(event.result.message)
        if type(event) in self.manual_host:
            self.host_inbox.append(event)
            return
        host = self.host
        if isinstance(event, ev.OpenSession):
            self.live[event.session_id] = set()
            host.session_opened(event.request_id)
        elif isinstance(event, ev.StartExecute):
            cell = self.admit(event)
            if cell is not None:
                self.respond(event, cell)
        elif isinstance(event, ev.StartWait):
            self.observe(event.request_id, event.session_id, str(event.request.cell_id))
        elif isinstance(event, ev.StartTerminate):
            self.observe(event.request_id, event.session_id, str(event.cell_id), terminate=True)
        elif isinstance(event, ev.StartShutdown):
            self.shut_down(event)
        elif isinstance(event, ev.CancelOperation):
            host.operation_cancelled(event.request_id)

    def new_cell(self) -> str:
        return f"cell-{next(self._cell_numbers)}"

    def admit(self, event: ev.StartExecute, cell: str | None = None) -> str | None:
        """Admit ``event``'s cell (a fresh id unless ``cell``); ``None`` when the client cancelled
        it first (the runtime then drops the cell it had created)."""
        cell = cell if cell is not None else self.new_cell()
        if not self.host.execution_started(event.request_id, CellId(cell)):
            self.host.cell_closed(event.session_id, CellId(cell))
            return None
        self.live.setdefault(event.session_id, set()).add(cell)
        return cell

    def respond(self, event: ev.StartExecute, cell: str) -> None:
        """The cell's first outcome: source ``yield`` keeps it running, anything else completes
        it with the source as its output."""
        if event.request.source == "yield":
            self.host.initial_response(event.request_id, Yielded(CellId(cell), [InputText("y")]))
            return
        response = Result(CellId(cell), [InputText(event.request.source)], None)
        self.host.initial_response(event.request_id, response)
        self.close_cell(event.session_id, cell)

    def close_cell(self, session_id: str, cell: str) -> None:
        """The runtime retires ``cell`` (once: a cell that is not live is left alone)."""
        live = self.live.get(session_id, set())
        if cell in live:
            live.discard(cell)
            self.host.cell_closed(session_id, CellId(cell))

    def observe(
        self, request_id: int, session_id: str, cell: str, *, terminate: bool = False
    ) -> None:
        """Answer a wait (the cell completes) or a terminate (the cell is terminated)."""
        if cell in self.live.get(session_id, set()):
            response: RuntimeResponse = (
                Terminated(CellId(cell)) if terminate else Result(CellId(cell), [InputText("w")])
            )
            self.host.wait_completed(request_id, LiveCell(response))
            self.close_cell(session_id, cell)
        else:
            self.host.wait_completed(request_id, MissingCell(Terminated(CellId(cell))))

    def shut_down(self, event: ev.StartShutdown) -> None:
        """The runtime closes every live cell of the session, then the session."""
        for cell in sorted(self.live.pop(event.session_id, set())):
            self.host.cell_closed(event.session_id, CellId(cell))
        self.host.session_shut_down(event.request_id)

    # -- inspection ------------------------------------------------------------------------------------

    def client_of(self, kind: type[T]) -> list[T]:
        """The client events of type ``kind``."""
        return [event for event in self.client_events if isinstance(event, kind)]

    def host_of(self, kind: type[T]) -> list[T]:
        """The host events of type ``kind``."""
        return [event for event in self.host_events if isinstance(event, kind)]
