"""Children that inherit nothing but their pipes, on any event loop.

asyncio's loop spawns with ``close_fds``; uvloop's spawn closes nothing and leaves the child extra
copies of the descriptors it was given as stdin, stdout and stderr. A child holding a copy of its
own stdout does not end that stream when it closes the descriptor 1, so the parent would wait for
an end of stream that never comes; an engine process would hold whatever its embedding program
left inheritable. Every child this package starts goes through :func:`child_preexec`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Collection

__all__ = ["child_preexec", "inherit_nothing"]


def inherit_nothing(keep: Collection[int] = ()) -> None:
    """Make every descriptor of this process above stderr close-on-exec, but those in ``keep``."""
    for name in os.listdir("/dev/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                os.set_inheritable(fd, False)


def child_preexec(
    loop: asyncio.AbstractEventLoop,
    then: Callable[[], None] | None = None,
    pass_fds: Collection[int] = (),
) -> Callable[[], None] | None:
    """The ``preexec_fn`` for a child spawned on ``loop``: ``then`` (may be None), preceded by
    :func:`inherit_nothing` where the loop's spawn does not close descriptors itself.
    ``pass_fds`` are the descriptors the spawn passes on (its own ``pass_fds``)."""
    if isinstance(loop, asyncio.BaseEventLoop):  # asyncio's own: close_fds
        return then

    def preexec_fn() -> None:
        inherit_nothing(pass_fds)
        if then is not None:
            then()

    return preexec_fn
