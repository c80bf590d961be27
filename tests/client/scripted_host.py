"""A misbehaving stand-in for ``codemode host --stdio``: ``python scripted_host.py MODE [ARG]``.

Modes: ``exit-now STATUS`` (exit before the handshake), ``silent`` (never answer the hello),
``exit-on-request STATUS`` (handshake, then exit at the first request), ``close-stdout`` (handshake,
close stdout, linger), ``basic`` (grant nothing; answer open/shutdown; log to stderr).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from codemode.protocol.v1.codec import MessageDecoder, encode_frame
from codemode.protocol.v1.messages import (
    ClientToHost,
    ConnectionReady,
    OperationRequest,
    OperationResponse,
    SessionClosed,
    SessionOpen,
    SessionReady,
    SessionShutdown,
    WireOk,
)

_DECODER: MessageDecoder[ClientToHost] = MessageDecoder(ClientToHost)


def read() -> Any:
    stdin = sys.stdin.buffer
    prefix = stdin.read(4)
    if len(prefix) < 4:
        return None
    return _DECODER.decode(stdin.read(int.from_bytes(prefix, "little")))


def write(message: Any) -> None:
    sys.stdout.buffer.write(encode_frame(message))
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
    write(ConnectionReady(1, ()))
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
