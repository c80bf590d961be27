"""Remote sessions: the V1 client over any frame transport and the process-owned provider."""

from codemode.client.process import (
    DEFAULT_HOST_COMMAND,
    HostProcess,
    ProcessOwnedCodeModeSessionProvider,
)
from codemode.client.v1 import RemoteSession, V1ClientConnection, connect_v1

__all__ = [
    "DEFAULT_HOST_COMMAND",
    "HostProcess",
    "ProcessOwnedCodeModeSessionProvider",
    "RemoteSession",
    "V1ClientConnection",
    "connect_v1",
]
