"""The embedded runtime: every cell runs in a bare V8 isolate of a confined engine process.

:class:`LocalSessionProvider` creates :class:`LocalSession` objects (the embedded
``CodeModeSession``); each session runs in an engine process of its own, taken from an
:class:`EnginePool` (``docs/security.md``).
"""

from codemode.runtime.engine import NodeEngine, find_node
from codemode.runtime.session import (
    EnginePool,
    InvalidLimitsError,
    LocalSession,
    LocalSessionProvider,
    check_limits,
)

__all__ = [
    "EnginePool",
    "InvalidLimitsError",
    "LocalSession",
    "LocalSessionProvider",
    "NodeEngine",
    "check_limits",
    "find_node",
]
