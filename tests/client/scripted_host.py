"""A misbehaving stand-in for ``codemode host --stdio``.

Run as ``python -m tests.client.scripted_host MODE [ARG]`` with the repository root on the path
(``test_process.scripted`` does). Modes: ``exit-now STATUS`` (exit before the handshake),
``silent`` (never answer the hello), ``exit-on-request STATUS`` (handshake, then exit at the first
request), ``close-stdout`` (handshake, close stdout, linger), ``basic`` (grant nothing; answer
open/shutdown; log to stderr).
"""

from __future__ import annotations

import os
import sys
import time

from codemode.protocol.v1.messages import (
    ClientToHost,
    HostToClient,
    OperationRequest,
    OperationResponse,
    SessionClosed,
    SessionOpen,
    SessionReady,
    SessionShutdown,
    WireOk,
)
from tests.wire import CLIENT_MESSAGES, frame, read_payload_blocking, ready


def read() -> ClientToHost | None:
    payload = read_payload_blocking(sys.stdin.buffer)
    return None if payload is None else CLIENT_MESSAGES.decode(payload)


def write(message: HostToClient) -> None:
    sys.stdout.buffer.write(frame(message))
    sys.stdout.buffer.flush()


def main() -> int:
    mode = sys.argv[1]
    argument = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if mode == "exit-now":
        return argument
    read()
    if mode == "silent":
        time.sleep(60)
        return 0
    write(ready(()))
    if mode == "close-stdout":
        sys.stdout.close()
        os.close(1)
        time.sleep(60)
        return 0
    print("scripted host ready", file=sys.stderr, flush=True)
    while (message := read()) is not None:
        if mode == "exit-on-request":
            return argument
        assert isinstance(message, OperationRequest)
        request = message.request
        if isinstance(request, SessionOpen):
            write(OperationResponse(message.id, WireOk(SessionReady(request.session_id))))
        elif isinstance(request, SessionShutdown):
            write(OperationResponse(message.id, WireOk(SessionClosed(request.session_id))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
