"""``codemode run`` (and ``doctor``, ``wire``) used as a demanding user would: signals during a
cell and during a tool call, Ctrl-C at a stdin prompt, standard descriptors closed, odd flag values,
``--json`` read by a program. Each test is a real subprocess; the ones about signals check from
/proc that no process of the run (its engines) outlives it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.commands import codemode

pytestmark = pytest.mark.timeout(60)

CODEMODE = [sys.executable, "-m", "codemode"]

SLOW_TOOL = (
    "import sys, time\n\n"
    "def slow(seconds: float) -> str:\n"
    "    print('tool started', file=sys.stderr, flush=True)\n"
    "    time.sleep(seconds)\n"
    "    return 'slept'\n"
)


@contextlib.contextmanager
def started(*args: str, stdin: bytes | None = b"") -> Iterator[subprocess.Popen[bytes]]:
    """``codemode ARGS`` in a process group of its own (its engines join it); killed at the end."""
    child = subprocess.Popen(
        [*CODEMODE, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert child.stdin is not None
    try:
        if stdin is not None:
            child.stdin.write(stdin)
            child.stdin.close()
        yield child
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream is not None:
                stream.close()


def group_gone(pgid: int, within: float = 3.0) -> bool:
    """True once no process of the group ``pgid`` is left (zombies aside)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                    if int(fields[2]) == pgid and fields[0] != "Z":
                        alive.append(entry)
        if not alive:
            return True
        time.sleep(0.05)
    return False


def engines_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry))
    return found


@pytest.mark.parametrize(
    ("signum", "during", "status", "message"),
    [
        (signal.SIGTERM, "cell", 143, b"codemode: stopped by SIGTERM\n"),
        (signal.SIGHUP, "cell", 129, b"codemode: stopped by SIGHUP\n"),
        (signal.SIGTERM, "tool", 143, b"codemode: stopped by SIGTERM\n"),
        (signal.SIGINT, "tool", 130, b"codemode: interrupted\n"),
    ],
    ids=["sigterm-spinning-cell", "sighup-spinning-cell", "sigterm-tool-call", "sigint-tool-call"],
)
def test_a_signal_stops_the_run_and_its_engine(
    tmp_path: Path, signum: signal.Signals, during: str, status: int, message: bytes
) -> None:
    # SIGTERM used to end the Python process only: the engine, busy in the cell, went on spinning
    # a CPU for ever (its exit at the end of its stdin waits for the running isolate).
    tools = tmp_path / "tools.py"
    tools.write_text(SLOW_TOOL)
    if during == "cell":
        source = b'text("a"); while (true) {}'
    else:
        source = b'text("a"); text(await tools.slow({seconds: 30}))'
    with started("run", "-", "--tools", str(tools), "--yield-ms", "200", stdin=source) as child:
        assert child.stdout is not None and child.stderr is not None
        if during == "cell":
            assert child.stdout.readline() == b"Script running with cell ID 1\n"
        else:
            assert child.stderr.readline() == b"tool started\n"
        assert engines_of(child.pid), "the run has no engine process"
        child.send_signal(signum)
        assert child.wait(timeout=10) == status
        assert child.stderr.read() == message
        assert group_gone(child.pid), "an engine outlived the run"


def test_ctrl_c_at_a_stdin_prompt_ends_the_run() -> None:
    # `codemode run -` read stdin inside the event loop: Ctrl-C only cancelled the run, the
    # read went on until the user typed the end of the input.
    with started("run", "-", stdin=None) as child:
        wchan = Path(f"/proc/{child.pid}/wchan")
        deadline = time.monotonic() + 20
        while "pipe" not in wchan.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)  # start-up: imports first, then the read of stdin
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=5) == 130
        assert child.stderr is not None
        assert child.stderr.read() == b"codemode: interrupted\n"


def run_with_closed(
    fd: int, *args: str, env: dict[str, str] | None = None
) -> tuple[int, bytes, bytes]:
    """``codemode ARGS`` started with descriptor ``fd`` closed; its status, stdout and stderr
    (what it wrote to the closed one is lost)."""
    command = ["sh", "-c", f'exec "$0" "$@" {fd}>&-', *CODEMODE, *args]
    done = subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False, env=env
    )
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize(
    ("fd", "loop"), [(0, "auto"), (1, "auto"), (1, "asyncio"), (2, "auto"), (2, "asyncio")]
)
def test_run_with_a_standard_descriptor_closed(tmp_path: Path, fd: int, loop: str) -> None:
    # uvloop aborted (a pipe of the engine took the free number 0-2; libuv asserts on closing
    # it); on asyncio's loop a closed stdout or stderr was an AttributeError traceback.
    cell = tmp_path / "cell.js"
    cell.write_text('text("ok")')
    status, out, errors = run_with_closed(fd, "run", str(cell), "--json", "--loop", loop)
    assert status == 0, errors
    assert errors == b""
    if fd != 1:
        assert json.loads(out)["Result"]["content_items"] == [{"type": "input_text", "text": "ok"}]


def test_run_stdin_closed_reads_an_empty_cell() -> None:
    status, _, errors = run_with_closed(0, "run", "-", "--loop", "asyncio")
    assert status == 2, errors  # the empty source's usage error, not a traceback
    assert errors.startswith(b"codemode: exec expects raw JavaScript source text (non-empty)")


@pytest.mark.parametrize(
    "args",
    [
        ("wire", "validate", "--type", "json"),
        ("wire", "frames", "-"),
    ],
    ids=["validate", "frames"],
)
@pytest.mark.parametrize("fd", [0, 1])
def test_wire_with_a_standard_descriptor_closed(fd: int, args: tuple[str, ...]) -> None:
    status, _, errors = run_with_closed(fd, *args)
    assert b"Traceback" not in errors, errors
    # An empty input: nothing to validate (exit 1, its error on stderr), no frames (exit 0).
    assert status == (1 if "validate" in args else 0), errors


def test_doctor_with_stdout_closed() -> None:
    status, _, errors = run_with_closed(1, "doctor")
    assert (status, errors) == (0, b"")


def test_yield_ms_0_waits_for_the_cell_to_complete() -> None:
    # A 0 ms wait answered without giving the event loop a turn: the run spun for ever without
    # reading the engine's output.
    source = b'text("a"); await new Promise(r => setTimeout(r, 200)); text("b")'
    for extra in ((), ("--timeout", "20")):
        done = codemode("run", "-", "--yield-ms", "0", "--json", *extra, stdin=source, timeout=20)
        assert done.returncode == 0, done.stderr
        items = json.loads(done.stdout)["Result"]["content_items"]
        assert [item["text"] for item in items] == ["a", "b"]


def test_a_timeout_too_large_to_count_in_ms_is_no_deadline() -> None:
    done = codemode("run", "-", "--timeout", "1e308", "--json", stdin=b'text("ok")')
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr
    assert json.loads(done.stdout)["Result"]["content_items"][0]["text"] == "ok"


def test_json_stdout_holds_the_json_only(tmp_path: Path) -> None:
    # What a tool file printed (at import, in a call, from a child process) went to stdout,
    # before the line of JSON a program reads there.
    tools = tmp_path / "tools.py"
    tools.write_text(
        "import subprocess\n"
        "print('loading')\n\n"
        "def chatty() -> int:\n"
        "    print('in the call')\n"
        "    subprocess.run(['echo', 'from a child'], check=True)\n"
        "    return 1\n"
    )
    source = b"text(String(await tools.chatty({})))"
    done = codemode("run", "-", "--tools", str(tools), "--json", stdin=source)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        b'{"Result":{"cell_id":"1","content_items":[{"type":"input_text","text":"1"}],'
        b'"error_text":null}}\n'
    )
    assert done.stderr == b"loading\nin the call\nfrom a child\n"


def test_a_tool_file_that_defines_no_tools_is_warned_about(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text("from os import getcwd\nLIMIT = 3\n\ndef _helper() -> int:\n    return 1\n")
    done = codemode("run", "-", "--tools", str(tools), stdin=b"text(typeof tools.getcwd)")
    assert done.returncode == 0, done.stderr
    assert (
        done.stderr
        == (
            f"codemode: warning: {tools} defines no tools (only its public top-level functions "
            "become tools)\n"
        ).encode()
    )


def without(*names: str, **values: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in names}
    return {**env, **values}


def test_doctor_fails_when_the_engine_cannot_start() -> None:
    # The addon was cached, so doctor never ran node: it said all was well and exited 0.
    done = subprocess.run(
        [*CODEMODE, "doctor"],
        capture_output=True,
        timeout=60,
        check=False,
        env=without(CODEMODE_NODE="/bin/false"),
    )
    assert done.returncode == 1, done.stdout
    assert b"engine: FAILED (" in done.stdout
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize("command", [("doctor",), ("run", "-")])
def test_a_cache_directory_that_cannot_be_made_is_an_error_not_a_traceback(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = subprocess.run(
        [*CODEMODE, *command],
        input=b"text(1)",
        capture_output=True,
        timeout=60,
        check=False,
        env=without("CODEMODE_ISOLATED_VM", CODEMODE_CACHE_DIR=str(blocker / "cache")),
    )
    assert done.returncode == 1
    assert b"Traceback" not in done.stderr, done.stderr
    assert b"Not a directory" in done.stdout + done.stderr


def on_a_terminal(
    args: list[str], source: bytes, *, stdout_too: bool
) -> tuple[subprocess.CompletedProcess[bytes], bytes]:
    """Run ``codemode run ARGS`` with stderr (and ``stdout_too``: stdout) on a pseudo-terminal:
    the run and what the terminal showed."""
    import pty
    import threading

    primary, secondary = pty.openpty()
    written = bytearray()

    def drain() -> None:  # the terminal's reader: a full pty would block the run's output
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the other end is closed: all was read
                return
            if not chunk:
                return
            written.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        done = subprocess.run(
            [*CODEMODE, "run", *args],
            input=source,
            stdout=secondary if stdout_too else subprocess.PIPE,
            stderr=secondary,
            timeout=60,
            check=False,
        )
    finally:
        os.close(secondary)
        reader.join(10)
        os.close(primary)
    return done, bytes(written)


def test_short_yields_on_a_terminal_print_progress_at_most_once_a_second() -> None:
    # Guards: with --yield-ms 1 every observation printed a "still running" line (a thousand a
    # second on a terminal).
    done, written = on_a_terminal(
        ["-", "--yield-ms", "1"],
        b"await new Promise(r => setTimeout(r, 1500)); text('ok')",
        stdout_too=False,
    )
    assert done.returncode == 0, written
    assert b"\nok\n" in done.stdout
    assert 1 <= written.count(b"still running") <= 2, written[-500:]


def test_control_characters_of_a_cell_reach_a_terminal_escaped() -> None:
    # A cell's text went raw to the terminal: it could recolour it, set its title, write the
    # clipboard (OSC 52) or rewrite the "Script completed" header with a carriage return.
    source = (
        b'text("A\\x1b[31mRED\\x1b]0;TITLE\\x07\\rZ\\u009b\\ttab\\u202eevil"); notify("\\x1b[2J")'
    )
    done, written = on_a_terminal(["-"], source, stdout_too=True)
    assert done.returncode == 0, written
    assert b"\x1b" not in written and b"\x07" not in written and "\x9b".encode() not in written
    assert "\u202e".encode() not in written
    assert b"A\\x1b[31mRED\\x1b]0;TITLE\\x07\\x0dZ\\u009b\ttab\\u202eevil" in written
    assert b"notify: \\x1b[2J" in written
    # Piped, the text is the cell's own.
    piped = subprocess.run(
        [*CODEMODE, "run", "-"], input=source, capture_output=True, timeout=60, check=False
    )
    assert "A\x1b[31mRED\x1b]0;TITLE\x07\rZ\x9b\ttab\u202eevil".encode() in piped.stdout


def test_json_on_a_terminal_escapes_what_json_leaves_raw() -> None:
    # JSON escapes C0 controls itself; DEL, C1 controls (U+009B is a CSI) and bidirectional
    # overrides it leaves raw, and they reached the terminal so.
    source = b'text("a\\u007fb\\u009b31mc\\u202ed")'
    done, written = on_a_terminal(["-", "--json"], source, stdout_too=True)
    assert done.returncode == 0, written
    for raw in ("\x7f", "\x9b", "\u202e"):
        assert raw.encode() not in written
    line = written[written.index(b'{"Result"') :].split(b"\n")[0].rstrip(b"\r")
    items = json.loads(line)["Result"]["content_items"]
    assert items == [{"type": "input_text", "text": "a\x7fb\x9b31mc\u202ed"}]


@pytest.mark.parametrize(
    ("source", "extra", "status"),
    [
        (b'text("x".repeat(1000000)); throw new Error("the cell failed")', (), 1),
        (
            b'text("x".repeat(1000000)); while (true) {}',
            ("--timeout", "1", "--yield-ms", "100"),
            124,
        ),
        (b'text("x".repeat(1000000))', (), 0),
    ],
    ids=["failed", "timed-out", "completed"],
)
def test_a_reader_that_stops_early_keeps_the_cells_status(
    source: bytes, extra: tuple[str, ...], status: int
) -> None:
    # The command line turned a broken pipe into status 0: `codemode run cell.js | head` said
    # a failed (or never-ending) cell had completed.
    with started("run", "-", "--max-output-tokens", "1000000", *extra, stdin=source) as child:
        assert child.stdout is not None and child.stderr is not None
        child.stdout.read(100)
        child.stdout.close()  # like `| head -c 100`
        assert child.wait(timeout=30) == status
        assert b"Traceback" not in child.stderr.read()
