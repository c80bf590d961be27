"""Children that inherit nothing but their pipes, on any event loop.

asyncio's loop spawns with ``close_fds``; uvloop's spawn closes nothing and leaves the child extra
copies of the descriptors it was given as stdin, stdout and stderr. A child holding a copy of its
own stdout does not end that stream when it closes the descriptor 1, so the parent would wait for
an end of stream that never comes; an engine process would hold whatever its embedding program
left inheritable. Every child this package starts goes through :func:`child_preexec`.

A child that runs cells also dies with the process that started it (``die_with_parent``): the end
of its stdin tells it to exit, but a process whose parent was killed can be in no state to hear it
(its exit waits for a cell's thread that runs a loop for ever), and an orphan spinning a CPU would
outlive every owner that could stop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Collection

__all__ = ["child_preexec", "die_with_parent", "inherit_nothing"]


def inherit_nothing(keep: Collection[int] = ()) -> None:
    """Make every descriptor of this process above stderr close-on-exec, but those in ``keep``."""
    for name in os.listdir("/dev/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                os.set_inheritable(fd, False)


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` step that makes the child get SIGKILL when its parent ends (Linux; None
    elsewhere). The parent is the thread that forks: children of an event loop are forked on its
    thread, and live no longer than it in any case."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec_fn() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os.write(2, b"codemode: prctl(PR_SET_PDEATHSIG) failed\n")
            os._exit(126)
        if os.getppid() != parent:  # the parent ended before the signal was asked for
            os._exit(1)

    return preexec_fn


_PR_SET_PDEATHSIG = 1


def child_preexec(
    loop: asyncio.AbstractEventLoop,
    then: Callable[[], None] | None = None,
    pass_fds: Collection[int] = (),
    *,
    bound_to_parent: bool = False,
) -> Callable[[], None] | None:
    """The ``preexec_fn`` for a child spawned on ``loop``: ``then`` (may be None), preceded by
    :func:`inherit_nothing` where the loop's spawn does not close descriptors itself, and by
    :func:`die_with_parent` if ``bound_to_parent``. ``pass_fds`` are the descriptors the spawn
    passes on (its own ``pass_fds``)."""
    steps = [step for step in (die_with_parent() if bound_to_parent else None, then) if step]
    if not isinstance(loop, asyncio.BaseEventLoop):  # asyncio's own spawn closes descriptors

        def inherit_only_passed() -> None:
            inherit_nothing(pass_fds)

        steps.insert(0, inherit_only_passed)
    if len(steps) <= 1:
        return steps[0] if steps else None

    def preexec_fn() -> None:
        for step in steps:
            step()

    return preexec_fn
