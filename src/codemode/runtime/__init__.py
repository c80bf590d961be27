"""The embedded runtime: cells run in V8 isolates of a Node.js worker-thread engine.

:class:`LocalSessionProvider` creates :class:`LocalSession` objects (the embedded
``CodeModeSession``); all sessions of a provider share one engine process.
"""

from codemode.runtime.engine import NodeEngine, find_node
from codemode.runtime.session import (
    InvalidLimitsError,
    LocalSession,
    LocalSessionProvider,
    check_limits,
)

__all__ = [
    "InvalidLimitsError",
    "LocalSession",
    "LocalSessionProvider",
    "NodeEngine",
    "check_limits",
    "find_node",
]
