"""``codemode doctor``: is the engine set up, which confinement layers apply here, and what a host
started here bounds by default."""

from __future__ import annotations

import argparse
import asyncio
import sys

from codemode.errors import CodeModeError
from codemode.runtime import confinement, find_node
from codemode.runtime.confinement import LAYERS
from codemode.runtime.engine import DEFAULT_MEMORY_CAP_BYTES, NodeEngine
from codemode.runtime.isolated_vm import VERSION as ISOLATED_VM_VERSION
from codemode.runtime.isolated_vm import ensure_isolated_vm
from codemode.runtime.session import (
    DEFAULT_MAX_ENGINES,
    DEFAULT_MAX_HELD_CHARS,
    DEFAULT_TOTAL_MEMORY_CAP_BYTES,
)

__all__ = ["add_parser"]


async def _start_engine(node: str) -> None:
    """Start an engine process with ``node`` (as the first cell of a run would), then stop it."""
    engine = NodeEngine(node=node)
    try:
        await engine.start()
    finally:
        await engine.aclose()


def _doctor_command(args: argparse.Namespace) -> int:
    """Print what the engine needs and which confinement layers apply here."""
    report = confinement.probe()
    try:
        node = find_node()
    except CodeModeError as error:
        print(f"node: MISSING ({error})")
        return 1
    print(f"node: {node}")
    try:
        addon = ensure_isolated_vm(node)
    except (CodeModeError, OSError) as error:  # OSError: e.g. a cache directory it cannot make
        print(f"isolated-vm {ISOLATED_VM_VERSION}: MISSING ({error})")
        return 1
    print(f"isolated-vm {ISOLATED_VM_VERSION}: {addon}")
    try:
        # The addon may be cached while the node binary cannot run it (or cannot run at all).
        asyncio.run(_start_engine(node))
    except (CodeModeError, OSError) as error:
        print(f"engine: FAILED ({error})")
        return 1
    print("engine: starts")
    print(report.describe())
    for layer in LAYERS:
        print(f"  {layer}: {'active' if layer in report.active() else 'MISSING'}")
    # What a host started here bounds by default (docs/cli.md): an operator sizing a machine.
    print(
        f"host defaults: --max-engines {DEFAULT_MAX_ENGINES}, --memory-cap "
        f"{DEFAULT_MEMORY_CAP_BYTES}, --total-memory-cap {DEFAULT_TOTAL_MEMORY_CAP_BYTES}, "
        f"--max-held-chars {DEFAULT_MAX_HELD_CHARS}"
    )
    if args.require_confinement and report.missing():
        print("codemode: required confinement layers are missing", file=sys.stderr)
        return 1
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``doctor`` command."""
    doctor = commands.add_parser(
        "doctor",
        help="check the engine set-up and which confinement layers apply here",
        description="Find Node.js, fetch the pinned isolated-vm addon if it is not cached yet, "
        "start an engine process once, and list the engine confinement layers this machine "
        "applies. Exit 1 if the engine cannot start, or (with --require-confinement) if a layer "
        "is missing.",
    )
    doctor.add_argument(
        "--require-confinement", action="store_true", help="fail if any layer is missing"
    )
    doctor.set_defaults(handler=_doctor_command)
