"""How long a remote client waits for its host (``grpc.md`` §13.3, decision 0020): one rule for
the V1 clients and the gRPC client.

Every request is given the provider's ``response_timeout`` (``TRANSPORT_ALLOWANCE``, 60 s, unless
the user changes it) past its runtime allowance; a host that lets it pass is given up as silent.
"""

from __future__ import annotations

from typing import Final

from codemode.protocol.constants import TRANSPORT_ALLOWANCE

__all__ = ["DEFAULT_RESPONSE_TIMEOUT", "observation_allowance"]

#: The default ``response_timeout`` of every remote provider.
DEFAULT_RESPONSE_TIMEOUT: Final = TRANSPORT_ALLOWANCE


def observation_allowance(yield_time_ms: int) -> float:
    """The runtime allowance of an execute (until its initial response) or a wait that observes
    for ``yield_time_ms``: that time plus 1 s."""
    return yield_time_ms / 1000 + 1
