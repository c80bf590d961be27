"""``--loop``: the long-running commands run on uvloop where it is installed (``auto``), on
asyncio where it is not or when asked, and ``--loop uvloop`` without it is a usage error.

"Not installed" is real here: the command runs in an interpreter where ``import uvloop`` fails
(``sys.modules["uvloop"] = None`` is how Python marks a module unimportable), not a mock.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codemode.cli.codex_host import host_arguments
from codemode.client import ProcessOwnedCodeModeSessionProvider
from codemode.protocol import InputText
from tests.commands import codemode
from tests.contract.delegate import RecordingDelegate
from tests.contract.helpers import run

needs_uvloop = pytest.mark.skipif(
    importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
)


def without_uvloop(entry: str = "codemode.cli") -> list[str]:
    """``python -c`` running ``entry``'s ``main`` where ``import uvloop`` fails."""
    code = f"import sys; sys.modules['uvloop'] = None; from {entry} import main; sys.exit(main())"
    return [sys.executable, "-c", code]


async def served(command: list[str], caplog: pytest.LogCaptureFixture) -> str:
    """Run a cell that calls a tool on the host ``command`` starts; the host's stderr lines."""
    caplog.set_level(logging.DEBUG, logger="codemode.client.process")
    provider = ProcessOwnedCodeModeSessionProvider(command)
    try:
        session = await provider.create_session(RecordingDelegate())
        result = await run(session, "text(JSON.stringify(await tools.echo({ a: 1 })))")
        assert result.content_items == [InputText('{"a":1}')]
        await session.shutdown()
    finally:
        await provider.aclose()
    return caplog.text


@needs_uvloop
async def test_host_serves_a_cell_on_uvloop(caplog: pytest.LogCaptureFixture) -> None:
    command = [sys.executable, "-m", "codemode", "host", "--stdio", "--loop", "uvloop"]
    assert "event loop: uvloop" in await served([*command, "--verbose"], caplog)


@needs_uvloop
async def test_auto_is_uvloop_where_it_is_installed(caplog: pytest.LogCaptureFixture) -> None:
    command = [sys.executable, "-m", "codemode", "host", "--stdio", "--verbose"]
    assert "event loop: uvloop" in await served(command, caplog)


async def test_auto_is_asyncio_where_uvloop_is_missing(caplog: pytest.LogCaptureFixture) -> None:
    command = [*without_uvloop(), "host", "--stdio", "--verbose"]
    assert "event loop: asyncio" in await served(command, caplog)


@pytest.mark.parametrize(
    ("entry", "arguments"),
    [
        ("codemode.cli", ["host", "--stdio"]),
        ("codemode.cli", ["run", "-"]),
        ("codemode.cli.codex_host", []),
    ],
)
def test_loop_uvloop_where_it_is_missing_is_a_usage_error(entry: str, arguments: list[str]) -> None:
    result = subprocess.run(
        [*without_uvloop(entry), *arguments, "--loop", "uvloop"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert (
        b"argument --loop: uvloop is not installed: pip install 'codemode[fast]'" in result.stderr
    )


@needs_uvloop
def test_run_on_uvloop() -> None:
    result = codemode("run", "-", "--loop", "uvloop", stdin=b"text(await Promise.resolve('hi'))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(b"\nhi\n")


def test_codex_host_passes_the_loop_on() -> None:
    assert host_arguments(["--loop", "asyncio"]) == [
        "host",
        "--stdio",
        "--wire-revision",
        "auto",
        "--loop",
        "asyncio",
    ]
    assert host_arguments(["--listen", "grpc+stdio://", "--loop", "asyncio"]) == [
        "host",
        "--listen",
        "grpc+stdio://",
        "--loop",
        "asyncio",
    ]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _program(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:  # ended, or between fork and exec
        return ""


def _open_files(pid: int) -> set[str]:
    opened = set()
    for link in Path(f"/proc/{pid}/fd").iterdir():
        try:
            opened.add(os.readlink(link))
        except OSError:
            continue
    return opened


@needs_uvloop
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_uvloop_host_hands_no_inherited_descriptor_to_its_engine() -> None:
    # uvloop spawns without close_fds: a descriptor the host inherited (as a uvloop client's
    # spawn leaves it a copy of its own stdout) would otherwise live on in its engines.
    read_end, write_end = os.pipe()
    pipe = os.readlink(f"/proc/self/fd/{write_end}")
    host = subprocess.Popen(
        [sys.executable, "-m", "codemode", "host", "--stdio", "--loop", "uvloop"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(write_end,),
    )
    os.close(write_end)
    try:
        assert pipe in _open_files(host.pid)  # inherited
        host_program = _program(host.pid)
        engines: list[int] = []
        deadline = time.monotonic() + 30
        while not engines and time.monotonic() < deadline:  # the host warms one at start
            time.sleep(0.05)
            # A child seen between its fork and its exec still holds every descriptor of the
            # host: only one that runs its own program yet is an engine.
            engines = [
                pid for pid in _children(host.pid) if _program(pid) not in ("", host_program)
            ]
        assert engines
        for engine in engines:
            assert pipe not in _open_files(engine)
    finally:
        assert host.stdin is not None
        host.stdin.close()
        host.wait(30)
        os.close(read_end)


@pytest.mark.parametrize("loop", ["asyncio", pytest.param("uvloop", marks=needs_uvloop)])
def test_a_stdio_host_on_dev_null_ends_as_at_the_end_of_stdin(loop: str) -> None:
    """epoll refuses /dev/null: asyncio used to wait forever, uvloop aborted the process."""
    with open(os.devnull, "rb") as null:
        result = subprocess.run(
            [sys.executable, "-m", "codemode", "host", "--stdio", "--loop", loop],
            stdin=null,
            capture_output=True,
            timeout=30,
            check=False,
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout == b""
