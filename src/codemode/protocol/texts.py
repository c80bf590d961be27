"""Exact texts every carrier shares: the session API's errors and how a delegate's callback fails.

The embedded runtime and the remote carriers raise and answer with these same strings
(``protocol-v1.md`` Appendix B, codes in the comments), so a caller cannot tell them apart.
"""

from __future__ import annotations

from typing import Final

from codemode.protocol.constants import MAX_PENDING_DELEGATE_CALLS

#: C8
PROVIDER_DOES_NOT_SUPPORT_LIMITS: Final = (
    "code-mode session provider does not support resource limits"
)
#: C9 (the spelling ``code mode`` is upstream's)
SESSION_SHUTTING_DOWN: Final = "code mode session is shutting down"
#: C11
EXEC_RUNTIME_ENDED_UNEXPECTEDLY: Final = "exec runtime ended unexpectedly"
#: C12
NESTED_TOOLS_UNAVAILABLE: Final = "code mode nested tools are unavailable"
#: J1 / D1: unresolved callbacks of one connection (or one embedded session) are capped.
TOO_MANY_CALLBACKS: Final = (
    f"code-mode host exceeded the limit of {MAX_PENDING_DELEGATE_CALLS} pending delegate calls"
)
#: What a callback whose task was itself cancelled answers.
DELEGATE_TASK_CANCELLED: Final = "code-mode delegate task was cancelled"


def delegate_task_failed(detail: str) -> str:
    """D4: the delegate raised something other than a ``CodeModeError``."""
    return f"code-mode delegate task failed: {detail}"


def delegate_result_not_json(detail: str) -> str:
    """D5: the delegate returned a value that cannot be written as JSON."""
    return f"code-mode delegate returned a value that is not JSON: {detail}"


def notification_not_delivered(message: str) -> str:
    """L7: a log line (the spelling ``code mode`` is upstream's)."""
    return f"failed to deliver code mode notification: {message}"


def host_spawn_failed(program: str, error: object) -> str:
    """C1: a host child process could not be started."""
    return f"failed to spawn code-mode host {program}: {error}"


def host_unreachable(url: str, detail: str) -> str:
    """C1's counterpart for a network host: its socket could not be opened."""
    return f"failed to connect to code-mode host {url}: {detail}"
