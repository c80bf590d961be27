"""What several commands share: argument types, engine options, the embedded provider, the
event loop."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from codemode.protocol.v1 import WireRevision
from codemode.protocol.v1.revision import AUTO_REVISION
from codemode.runtime import LocalSessionProvider
from codemode.runtime.engine import DEFAULT_MEMORY_CAP_BYTES
from codemode.runtime.session import DEFAULT_MAX_HELD_CHARS, DEFAULT_TOTAL_MEMORY_CAP_BYTES

__all__ = [
    "LOOPS",
    "at_most",
    "engine_arguments",
    "local_provider",
    "loop_argument",
    "non_negative",
    "positive",
    "positive_seconds",
    "run_main",
    "wire_revision_argument",
]

_T = TypeVar("_T")

#: The ``--loop`` choices: ``auto`` is uvloop where it is installed, else asyncio's own loop.
LOOPS: Final = ("auto", "asyncio", "uvloop")
_NOT_INSTALLED: Final = "uvloop is not installed: pip install 'codemode[fast]'"


def non_negative(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def at_most(maximum: int, spelled: str) -> Callable[[str], int]:
    """An argparse type: an integer from 0 to ``maximum`` (``spelled`` out in the error, e.g.
    ``2^31 - 1``): a larger one is a usage error here, not a conversion failure in the run."""

    def parse(text: str) -> int:
        value = non_negative(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(
                f"expected an integer from 0 to {maximum} ({spelled}), got {text!r}"
            )
        return value

    return parse


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a positive integer, got 0")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def non_negative_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds from 0 up, got {text!r}")
    return value


def wire_revision_argument(
    parser: argparse.ArgumentParser, what: str, *, auto: bool = False
) -> None:
    """Add ``--wire-revision`` (``what`` says what it selects; ``auto`` offers ``auto``)."""
    choices: list[str] = [*WireRevision, AUTO_REVISION] if auto else list(WireRevision)
    extra = (
        "; auto: each client's hello decides (latest when it offers a capability the pinned "
        "revision does not define)"
        if auto
        else ""
    )
    parser.add_argument(
        "--wire-revision",
        type=lambda value: value if value == AUTO_REVISION and auto else WireRevision(value),
        choices=choices,
        default=WireRevision.PINNED,
        metavar="{" + ",".join(choices) + "}",
        help=f"{what}: pinned (V1 as pinned, the default) or latest (upstream 0.164+: "
        f"runtime responses carry code_mode_host_duration_ns and result_buffered_for_ns){extra}",
    )


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine options ``run`` and ``host`` share."""
    parser.add_argument(
        "--memory-cap",
        type=positive,
        default=DEFAULT_MEMORY_CAP_BYTES,
        metavar="BYTES",
        help="resident-memory cap of each session's engine process (past it, its cells end)",
    )
    parser.add_argument(
        "--require-confinement",
        action="store_true",
        help="refuse to run cells where an OS confinement layer is unavailable",
    )
    parser.add_argument(
        "--shared-engine",
        action="store_true",
        help="run all sessions in one engine process (one trust domain)",
    )
    parser.add_argument(
        "--console",
        action="store_true",
        help="give cells a console whose log/info/warn/error/debug append text (off: as upstream)",
    )


def local_provider(
    args: argparse.Namespace, *, store_load: bool = True, warm_engines: int = 1
) -> LocalSessionProvider:
    """The embedded runtime, configured by the engine options; ``warm_engines`` started engines
    wait for the next session (0 for one session, as ``run`` opens)."""
    return LocalSessionProvider(
        store_load=store_load,
        warm_engines=warm_engines,
        max_engines=getattr(args, "max_engines", None) or None,
        max_held_chars=getattr(args, "max_held_chars", DEFAULT_MAX_HELD_CHARS) or None,
        total_memory_cap_bytes=(
            getattr(args, "total_memory_cap", DEFAULT_TOTAL_MEMORY_CAP_BYTES) or None
        ),
        console=args.console,
        shared_engine=args.shared_engine,
        memory_cap_bytes=args.memory_cap,
        require_confinement=args.require_confinement,
    )


def _loop_choice(text: str) -> str:
    """An argparse type: a ``--loop`` choice; ``uvloop`` must be importable (else a usage
    error, not a failure after start-up)."""
    if text == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise argparse.ArgumentTypeError(_NOT_INSTALLED) from None
    return text


def loop_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--loop {auto,asyncio,uvloop}`` (the event loop :func:`run_main` runs on)."""
    parser.add_argument(
        "--loop",
        type=_loop_choice,
        choices=LOOPS,
        default="auto",
        help="the event loop: uvloop (needs codemode[fast]), asyncio, or auto, the default: "
        "uvloop where it is installed, else asyncio",
    )


def _loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the ``--loop`` choice; ``None`` is asyncio's default loop."""
    if loop == "asyncio":
        return None
    try:
        # Imported only here: the commands that never run a loop do not pay for it.
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise RuntimeError(_NOT_INSTALLED) from None
        return None
    return uvloop.new_event_loop


def run_main(main: Callable[[], Coroutine[Any, Any, _T]], loop: str = "auto") -> _T:
    """``asyncio.run(main())`` on the event loop ``loop`` names (a :data:`LOOPS` choice)."""
    with asyncio.Runner(loop_factory=_loop_factory(loop)) as runner:
        kind = type(runner.get_loop()).__module__.partition(".")[0]
        logging.getLogger("codemode.cli").debug("event loop: %s", kind)  # --verbose shows it
        if kind == "uvloop":
            from codemode.spawning import inherit_nothing

            # What we inherited (e.g. the copy of its stdout a uvloop client's spawn leaves
            # us) would otherwise outlive us in our engines: that client would not see us end.
            inherit_nothing()
        # What start-up made (modules, classes, functions) lives as long as the process: out of
        # the collector's reach, the full collections a busy host runs visit a quarter of the
        # objects (host CPU per parallel nested call 23 -> 21 us; decision 0011).
        gc.freeze()
        return runner.run(main())
