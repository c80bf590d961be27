"""``codemode run``: one cell on the embedded runtime, shown as the model would see it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from typing import Final, TextIO

from codemode.cli.common import (
    at_most,
    engine_arguments,
    local_provider,
    loop_argument,
    positive_seconds,
    run_main,
)
from codemode.errors import CodeModeError
from codemode.model.exec_tool import build_exec_description
from codemode.model.positions import in_source_lines
from codemode.model.registry import NotifyCallback, ToolRegistry
from codemode.model.render import render_response
from codemode.model.toolfile import load_tool_file
from codemode.protocol import (
    CellId,
    ContentItem,
    ExecuteRequest,
    InputImage,
    InputText,
    ParsedExecSource,
    Result,
    RuntimeResponse,
    Terminated,
    WaitRequest,
    Yielded,
    parse_exec_source,
)
from codemode.protocol.constants import (
    DEFAULT_EXEC_YIELD_TIME_MS,
    DEFAULT_WAIT_YIELD_TIME_MS,
    I32_MAX,
    MAX_FRAME_BYTES,
    MAX_JS_SAFE_INTEGER,
)
from codemode.protocol.v1 import encode_payload
from codemode.protocol.v1.conversions import runtime_response_to_wire

__all__ = ["add_parser"]

#: Exit status of a run whose cell was terminated at --timeout (as timeout(1) exits).
TIMED_OUT = 124
#: Exit status of a run interrupted by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
#: Signals that stop a run as Ctrl-C does (its engine stopped, not left running); the exit
#: status is 128 + the signal's number.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _describe_item(item: ContentItem) -> str:
    if isinstance(item, InputText):
        return item.text
    url = item.image_url if isinstance(item, InputImage) else item.audio_url
    kind = "image" if isinstance(item, InputImage) else "audio"
    shown = url if len(url) <= 72 else url[:60] + f"… ({len(url)} chars)"
    detail = f", detail {item.detail.value}" if isinstance(item, InputImage) and item.detail else ""
    return f"[{kind}: {shown}{detail}]"


#: What a cell's text could steer a terminal with (colours, cursor moves, a window title, the
#: clipboard, a line rewritten with a carriage return, text shown in another order than it is):
#: control characters other than tab and newline, and the bidirectional embeddings, overrides
#: and isolates, shown as escapes on a terminal.
_BIDI_CONTROLS: Final = (*range(0x202A, 0x202F), *range(0x2066, 0x206A))
_TERMINAL_ESCAPES: Final = {
    code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F) if code not in (0x09, 0x0A)
} | {code: f"\\u{code:04x}" for code in (*range(0x80, 0xA0), *_BIDI_CONTROLS)}
#: The same for --json on a terminal (JSON escapes the other controls itself), as JSON escapes.
_JSON_TERMINAL_ESCAPES: Final = {
    code: f"\\u{code:04x}" for code in (0x7F, *range(0x80, 0xA0), *_BIDI_CONTROLS)
}


def _for(stream: TextIO, text: str) -> str:
    """``text`` as it may be written to ``stream``: escaped if that is a terminal."""
    return text.translate(_TERMINAL_ESCAPES) if stream.isatty() else text


def _discard(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null: its reader went away (``| head``), and what
    is still written to it (buffered text, a later line) is dropped instead of failing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


def _say(text: str, stream: TextIO) -> None:
    """Print ``text`` to ``stream``; a reader that went away ends the printing, not the run: the
    cell goes on to its own end, which gives the exit status (1 failed, 124 timed out, ...)."""
    try:
        print(_for(stream, text), file=stream, flush=True)
    except BrokenPipeError:
        _discard(stream)


def _print_rendered(response: RuntimeResponse, seconds: float, max_tokens: int | None) -> None:
    rendered = render_response(response, seconds, max_tokens)
    _say("\n".join(_describe_item(item) for item in rendered.items), sys.stdout)


def _mcp_server(text: str) -> tuple[str, list[str]]:
    """An argparse type: ``NAME=COMMAND ARGS`` (the command split as a POSIX shell would)."""
    name, equals, command = text.partition("=")
    if not equals or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME='COMMAND ARGS', got {text!r}")
    try:
        argv = shlex.split(command)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"cannot split the command of {name}: {error}") from None
    if not argv:
        raise argparse.ArgumentTypeError(f"MCP server {name} has no command")
    return name.strip(), argv


def _leaf_errors(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaf_errors(inner)]
    return [error]


async def _start_mcp_servers(
    stack: contextlib.AsyncExitStack, registry: ToolRegistry, servers: list[tuple[str, list[str]]]
) -> None:
    """Start each stdio MCP server of ``--mcp`` for the run and register its tools."""
    if not servers:
        return  # the MCP SDK takes longer to import than the rest of a run
    try:
        from mcp import StdioServerParameters

        from codemode.tools.mcp import mcp_tools
    except ImportError:
        raise CodeModeError("--mcp needs the MCP SDK: pip install 'codemode[mcp]'") from None
    for name, argv in servers:
        parameters = StdioServerParameters(command=argv[0], args=argv[1:])
        try:
            tools = await stack.enter_async_context(mcp_tools(name, parameters))
        except Exception as error:
            reasons = "; ".join(f"{type(leaf).__name__}: {leaf}" for leaf in _leaf_errors(error))
            raise CodeModeError(
                f"cannot start MCP server {name} ({shlex.join(argv)}): {reasons}"
            ) from None
        for item in tools:
            try:
                registry.add(item)
            except ValueError as error:
                raise CodeModeError(f"MCP server {name}: {error}") from None


#: At most one "still running" line on a terminal this often (seconds), however short the yields.
PROGRESS_INTERVAL: Final = 1.0
#: The longest source ``run`` reads (bytes): what one V1 frame carries.
MAX_SOURCE_BYTES: Final = MAX_FRAME_BYTES


def _read_source(args: argparse.Namespace) -> str | None:
    """The cell's source, read before the event loop starts (there, a blocking read of a
    terminal would not end at Ctrl-C); None: a usage error, reported."""
    if args.file is None:
        print("codemode: run needs FILE (or - for stdin), or --describe", file=sys.stderr)
        return None
    try:
        # Bounded: a cell's source travels in one frame on every carrier, and a FILE such as
        # /dev/zero or an endless pipe would otherwise be read until memory runs out.
        if args.file == "-":
            data = sys.stdin.buffer.read(MAX_SOURCE_BYTES + 1)
        else:
            with open(args.file, "rb") as file:
                data = file.read(MAX_SOURCE_BYTES + 1)
        if len(data) > MAX_SOURCE_BYTES:
            print(
                f"codemode: cannot read {args.file}: longer than {MAX_SOURCE_BYTES} bytes "
                "(a cell's source must fit in one protocol frame)",
                file=sys.stderr,
            )
            return None
        # Line ends as text mode reads them (the source was read that way before). utf-8-sig:
        # the byte order mark an editor may save first is no text of the cell, and before the
        # pragma it would hide it (the first line would not start with `// @exec:`).
        return data.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    except OSError as error:
        print(f"codemode: cannot read {args.file}: {error.strerror}", file=sys.stderr)
        return None
    except UnicodeError as error:
        print(f"codemode: cannot read {args.file}: not UTF-8 text ({error})", file=sys.stderr)
        return None


async def _stoppable(args: argparse.Namespace, source: str | None) -> int:
    """:func:`_run`, stopped at SIGTERM or SIGHUP as Ctrl-C stops it: cancelled, so that its
    engine is stopped on the way out (the default action would end this process only, and an
    engine busy in a cell would go on running)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    received: list[signal.Signals] = []

    def stop(signum: signal.Signals) -> None:
        if not received:
            received.append(signum)
            task.cancel()

    for signum in _STOP_SIGNALS:
        loop.add_signal_handler(signum, stop, signum)
    try:
        status = await _run(args, source)
    except asyncio.CancelledError:
        if not received:
            raise
    finally:
        for signum in _STOP_SIGNALS:
            loop.remove_signal_handler(signum)
    if received:
        _say(f"codemode: stopped by {received[0].name}", sys.stderr)
        return 128 + received[0].value
    return status


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what is written to descriptor 1 (a tool's print, a child it starts) to stderr
    meanwhile: with --json, stdout carries the one line of JSON only."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


async def _run(args: argparse.Namespace, source: str | None) -> int:
    if args.describe:
        return await _describe(args)
    assert source is not None

    def show_notification(call_id: str, cell_id: CellId, text: str) -> None:
        _say(f"notify: {text}", sys.stderr)

    try:
        parsed = parse_exec_source(source)
    except CodeModeError as error:
        print(f"codemode: {error}", file=sys.stderr)
        return 2
    if parsed.max_output_tokens is not None and parsed.max_output_tokens > I32_MAX:
        # The pragma allows up to 2^53 - 1 (runtime.md §14); the request to the runtime then
        # fails its conversion with a text that names neither the field nor the bound.
        print(
            f"codemode: exec pragma field `max_output_tokens` must be at most {I32_MAX} "
            f"(2^31 - 1, what the runtime's protocol carries), got {parsed.max_output_tokens}",
            file=sys.stderr,
        )
        return 2
    final: list[bytes] = []
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        async with contextlib.AsyncExitStack() as servers:
            registry = await _tools(servers, args, show_notification)
            if registry is None:
                return 2
            status = await _run_cell(args, parsed, registry, final)
    if final:
        line = final[0]
        if sys.stdout.isatty():
            line = line.decode().translate(_JSON_TERMINAL_ESCAPES).encode()
        try:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        except BrokenPipeError:
            _discard(sys.stdout)
    return status


async def _describe(args: argparse.Namespace) -> int:
    async with contextlib.AsyncExitStack() as servers:
        registry = await _tools(servers, args)
        if registry is None:
            return 2
        description = build_exec_description(
            registry.definitions(),
            code_mode_only=True,
            namespace_descriptions=registry.namespace_descriptions(),
            console=args.console,
        )
    print(description)
    return 0


async def _tools(
    servers: contextlib.AsyncExitStack,
    args: argparse.Namespace,
    on_notify: NotifyCallback | None = None,
) -> ToolRegistry | None:
    """The tools of --tools and --mcp (servers started on ``servers``); None: a usage error."""
    registry = ToolRegistry(on_notify=on_notify)
    try:
        for path in args.tools or []:
            before = len(registry.definitions())
            load_tool_file(path, registry=registry)
            if len(registry.definitions()) == before:
                print(
                    f"codemode: warning: {path} defines no tools (only its public top-level "
                    "functions become tools)",
                    file=sys.stderr,
                )
        await _start_mcp_servers(servers, registry, args.mcp or [])
    except CodeModeError as error:
        print(f"codemode: {error}", file=sys.stderr)
        return None
    return registry


async def _run_cell(
    args: argparse.Namespace, parsed: ParsedExecSource, registry: ToolRegistry, out: list[bytes]
) -> int:
    """Run the cell; with --json its final response's line is appended to ``out``."""
    yield_ms = args.yield_ms if args.yield_ms is not None else parsed.yield_time_ms
    max_tokens = args.max_output_tokens
    if max_tokens is None:
        max_tokens = parsed.max_output_tokens
    progress = sys.stderr.isatty() and not args.json
    started_at = time.monotonic()
    progress_at = started_at
    deadline = None if args.timeout is None else started_at + args.timeout

    def capped(ms: int) -> int:
        # Each observation ends by the deadline, so the cell is stopped there and not later.
        if deadline is None:
            return ms
        left = (deadline - time.monotonic()) * 1000  # a float: inf for --timeout 1e308
        return ms if left >= ms else max(0, int(left))

    collected: list[ContentItem] = []
    async with local_provider(args, warm_engines=0) as provider:  # one session: no spare
        session = await provider.create_session(registry)
        cell = await session.execute(
            ExecuteRequest(
                tool_call_id="run-1",
                source=parsed.code,
                enabled_tools=registry.definitions(),
                yield_time_ms=yield_ms
                if deadline is None
                else capped(DEFAULT_EXEC_YIELD_TIME_MS if yield_ms is None else yield_ms),
                max_output_tokens=max_tokens,
            )
        )
        response = await cell.initial_response()
        observed_at = started_at
        timed_out = False
        while True:
            response = in_source_lines(response, parsed.removed_lines)
            now = time.monotonic()
            collected.extend(response.content_items)
            if not args.json and (response.content_items or not isinstance(response, Yielded)):
                # The time since the last response printed: a silent yield is not one.
                _print_rendered(response, now - observed_at, max_tokens)
                observed_at = now
            elif progress and now - progress_at >= PROGRESS_INTERVAL:
                progress_at = now
                _say(f"… cell {cell.cell_id} still running ({now - started_at:.1f} s)", sys.stderr)
            if not isinstance(response, Yielded):
                break
            if deadline is not None and now >= deadline:
                timed_out = True
                outcome = await session.terminate(cell.cell_id)
            else:
                # At least 1 ms: a wait of 0 ms answers without giving the event loop a turn,
                # and this loop would then never read the engine's output (the cell's end).
                wait_ms = DEFAULT_WAIT_YIELD_TIME_MS if yield_ms is None else max(1, yield_ms)
                outcome = await session.wait(WaitRequest(cell.cell_id, capped(wait_ms)))
            response = outcome.response
    if args.json:
        final: RuntimeResponse
        if isinstance(response, Result):
            final = Result(response.cell_id, collected, response.error_text)
        else:
            final = Terminated(response.cell_id, collected)
        out.append(encode_payload(runtime_response_to_wire(final)) + b"\n")
    if timed_out and not isinstance(response, Result):
        _say(f"codemode: the cell was terminated after --timeout {args.timeout:g} s", sys.stderr)
        return TIMED_OUT
    failed = isinstance(response, Result) and response.error_text is not None
    return 1 if failed else 0


def _run_command(args: argparse.Namespace) -> int:
    try:
        source = None if args.describe else _read_source(args)
        if source is None and not args.describe:
            return 2
        return run_main(lambda: _stoppable(args, source), args.loop)
    except CodeModeError as error:
        print(f"codemode: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # --describe's reader went away: the command line's normal end (status 0)
    except OSError as error:  # e.g. the engine's cache directory cannot be made
        print(f"codemode: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("codemode: interrupted", file=sys.stderr)
        return INTERRUPTED


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``run`` command."""
    run = commands.add_parser(
        "run",
        help="run one JavaScript cell on the embedded runtime",
        description="Run FILE (or - for stdin) as one code-mode cell, exactly as the exec tool "
        "would: a first-line `// @exec: {...}` pragma is honoured, the cell can call the tools "
        "of --tools and --mcp, and a cell that yields is waited on until it completes. Prints what the "
        "model would see; --json prints the final RuntimeResponse (all items of the run) as one "
        "line of V1 wire JSON; --describe prints the exec tool's description instead. Exit status: "
        "0 completed, 1 script error, 2 usage error, 124 terminated at --timeout, 130 "
        "interrupted (Ctrl-C), 143 / 129 stopped by SIGTERM / SIGHUP.",
    )
    run.add_argument(
        "file", nargs="?", metavar="FILE", help="JavaScript source file, or - for stdin"
    )
    run.add_argument(
        "--tools",
        action="append",
        metavar="PATH.py",
        help="Python file whose public top-level functions (sync or async) become tools, "
        "typed by their hints as @tool does (or, if it defines a ToolRegistry, the tools "
        "registered there, with its before_call and timeouts); it imports the modules beside it "
        "as a script would (repeatable; a tool name defined twice is a usage error)",
    )
    run.add_argument(
        "--mcp",
        action="append",
        type=_mcp_server,
        metavar="NAME='COMMAND ARGS'",
        help="start this stdio MCP server for the run; its tools are tools.mcp__NAME__TOOL "
        "(repeatable; needs codemode[mcp])",
    )
    run.add_argument(
        "--yield-ms",
        type=at_most(MAX_JS_SAFE_INTEGER, "2^53 - 1, as the pragma allows"),
        metavar="N",
        help="yield time of each observation",
    )
    run.add_argument(
        "--max-output-tokens",
        type=at_most(I32_MAX, "2^31 - 1, what the runtime's protocol carries"),
        metavar="N",
        help="output budget per observation",
    )
    run.add_argument(
        "--timeout",
        type=positive_seconds,
        metavar="SECONDS",
        help="terminate the cell if it has not completed after this long (exit status 124); "
        "by default a cell that yields is waited on until it completes",
    )
    run.add_argument("--json", action="store_true", help="print the final response as wire JSON")
    run.add_argument(
        "--describe",
        action="store_true",
        help="print the exec tool description the model would get for these tools (each "
        "declared in TypeScript) instead of running a cell",
    )
    engine_arguments(run)
    loop_argument(run)
    run.set_defaults(handler=_run_command)
