"""``codex-code-mode-host``: this package's host behind the upstream host's command line.

The Codex CLI starts a program of that name next to its own executable, with no arguments
(V1 over stdio; releases up to 0.170) or with ``--listen grpc+stdio://`` (0.171+). This entry point
accepts exactly the upstream spellings and runs ``codemode host`` with what they mean:

* no arguments, ``--listen stdio`` or ``--listen stdio://``: Protocol V1 on stdin/stdout, in the
  wire revision the client's hello asks for (``--wire-revision auto``);
* ``--listen grpc+stdio://``: the gRPC service on stdin/stdout;
* ``--listen grpc://IP:PORT`` or ``ws://IP:PORT``: a network listener (loopback unless a token
  is configured, as ``codemode host`` requires).

``--otel-trace-listen`` / ``--otel-trace-exporter`` are accepted and ignored (with a log line):
this host exports no OpenTelemetry traces. ``--loop`` (not upstream's: Codex never passes it)
picks the event loop as for ``codemode host``. ``codemode codex link`` puts this program where a
Codex executable looks for it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from codemode.cli.common import loop_argument

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codex-code-mode-host",
        description="Serve code-mode cells for the Codex CLI (the upstream host's command line, "
        "served by codemode).",
    )
    parser.add_argument(
        "--listen",
        metavar="URL",
        default="stdio",
        help="transport endpoint: `stdio`, `stdio://`, `grpc+stdio://`, `grpc://IP:PORT` or "
        "`ws://IP:PORT` (default: stdio)",
    )
    parser.add_argument("--otel-trace-listen", metavar="URL", help="accepted and ignored")
    parser.add_argument("--otel-trace-exporter", metavar="URL", help="accepted and ignored")
    loop_argument(parser)
    return parser


def host_arguments(argv: Sequence[str] | None = None) -> list[str]:
    """The ``codemode`` arguments that serve what ``codex-code-mode-host ARGV`` asks for."""
    return _codemode_arguments(_parser().parse_args(argv))


def _codemode_arguments(args: argparse.Namespace) -> list[str]:
    loop = [] if args.loop == "auto" else ["--loop", args.loop]
    if args.listen in ("stdio", "stdio://"):
        return ["host", "--stdio", "--wire-revision", "auto", *loop]
    return ["host", "--listen", args.listen, *loop]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``codex-code-mode-host``; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.otel_trace_listen or args.otel_trace_exporter:
        print(
            "codex-code-mode-host: OpenTelemetry trace export is not supported: ignored",
            file=sys.stderr,
        )
    from codemode.cli import main as codemode_main

    return codemode_main(_codemode_arguments(args), only="host")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
