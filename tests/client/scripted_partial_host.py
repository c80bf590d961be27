"""A stand-in for ``codemode host --stdio`` that dies in the middle of a frame.

Run as ``python -m tests.client.scripted_partial_host MODE`` with the repository root on the path.
After the handshake it answers the first ``session/open``, then at the next request writes the
first half of an answer frame and: ``exit STATUS`` exits with that status; ``close`` closes its
stdout and lingers (a living host whose stream ended inside a frame).
"""

from __future__ import annotations

import os
import sys
import time

from codemode.protocol.v1.messages import (
    ClientToHost,
    OperationRequest,
    OperationResponse,
    SessionOpen,
    SessionReady,
    WireOk,
)
from tests.wire import CLIENT_MESSAGES, frame, read_payload_blocking, ready


def read() -> ClientToHost | None:
    payload = read_payload_blocking(sys.stdin.buffer)
    return None if payload is None else CLIENT_MESSAGES.decode(payload)


def write(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def main() -> int:
    mode = sys.argv[1]
    read()
    write(frame(ready(())))
    message = read()
    assert isinstance(message, OperationRequest) and isinstance(message.request, SessionOpen)
    answer = frame(OperationResponse(message.id, WireOk(SessionReady(message.request.session_id))))
    write(answer)
    message = read()
    assert isinstance(message, OperationRequest)
    write(answer[: len(answer) // 2])  # any frame: the stream ends inside it
    if mode == "exit":
        return int(sys.argv[2])
    sys.stdout.close()
    os.close(1)
    time.sleep(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
