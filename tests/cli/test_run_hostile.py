"""``codemode run`` given hostile cells and tool files: a clear message, never a traceback or hang."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.commands import codemode

pytestmark = pytest.mark.timeout(120)


def test_a_cell_file_that_is_not_utf8_is_a_usage_error(tmp_path: Path) -> None:
    cell = tmp_path / "cell.js"
    cell.write_bytes(b"text('\xff')\n")
    result = codemode("run", str(cell), timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(f"codemode: cannot read {cell}: not UTF-8 text (".encode())
    assert b"Traceback" not in result.stderr


def test_stdin_that_is_not_utf8_is_a_usage_error() -> None:
    # Undecodable bytes on stdin used to reach the engine as lone surrogates: the run hung.
    result = codemode("run", "-", stdin=b"text('\xff')\n", timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(b"codemode: cannot read -: not UTF-8 text (")


def test_an_endless_cell_file_is_a_usage_error_not_a_memory_leak() -> None:
    # Guards: /dev/zero (or an endless pipe) was read until memory ran out.
    result = codemode("run", "/dev/zero", timeout=60)
    assert result.returncode == 2
    assert result.stderr == (
        b"codemode: cannot read /dev/zero: longer than 67108864 bytes (a cell's source must fit "
        b"in one protocol frame)\n"
    )


def test_a_cell_file_keeps_reading_as_text_mode_did(tmp_path: Path) -> None:
    cell = tmp_path / "cell.js"
    # CRLF and CR line ends read as LF (a template literal would see them anyway), UTF-8 intact.
    cell.write_bytes("text(`a\r\nb`.length);\r\ntext('é')\r".encode())
    result = codemode("run", str(cell), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("Output:\n\n3\né\n".encode())


@pytest.mark.parametrize("where", ["file", "stdin"])
def test_a_byte_order_mark_does_not_hide_the_pragma(tmp_path: Path, where: str) -> None:
    # An editor's UTF-8 BOM before `// @exec:` made the first line no pragma: silently ignored.
    source = '\ufeff// @exec: {"max_output_tokens": 5}\ntext("x".repeat(400));\nnull.x\n'
    cell = tmp_path / "cell.js"
    cell.write_text(source, encoding="utf-8")
    if where == "file":
        result = codemode("run", str(cell), timeout=60)
    else:
        result = codemode("run", "-", stdin=source.encode(), timeout=60)
    assert result.returncode == 1, result.stderr
    assert b"Warning: truncated output (original token count: 124)" in result.stdout
    # The pragma line is counted: the error is on line 3 of the file.
    assert result.stdout.endswith(b"tokens truncated\xe2\x80\xa6in.mjs:3:6\n"), result.stdout


def test_a_pragma_nested_past_the_decoder_is_a_usage_error() -> None:
    source = b"// @exec: " + b"[" * 5000 + b"\ntext(1)\n"
    result = codemode("run", "-", stdin=source, timeout=60)
    assert result.returncode == 2
    assert result.stderr == (
        b"codemode: exec pragma must be valid JSON with supported fields `yield_time_ms` and "
        b"`max_output_tokens`: recursion limit exceeded\n"
    )


def test_a_tool_file_that_exits_at_import_is_reported(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text("import sys\nsys.exit(3)\n")
    result = codemode("run", "-", "--tools", str(tools), stdin=b"text(1)", timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"codemode: failed to load tools from {tools}: SystemExit: 3\n".encode()


def test_a_tool_that_calls_sys_exit_fails_its_call_and_the_run_goes_on(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text(
        "import argparse\n\n"
        "def grep(pattern: str) -> str:\n"
        "    parser = argparse.ArgumentParser(prog='grep', exit_on_error=False)\n"
        "    parser.add_argument('-n', type=int)\n"
        "    parser.parse_args([pattern])  # exits on what the cell passed\n"
        "    return pattern\n"
    )
    source = (
        b"try { await tools.grep({pattern: '--bogus'}); } catch (e) { text(String(e)); }\n"
        b"text('after');"
    )
    result = codemode("run", "-", "--tools", str(tools), "--json", stdin=source, timeout=60)
    assert result.returncode == 0, result.stderr
    texts = [item["text"] for item in json.loads(result.stdout)["Result"]["content_items"]]
    assert texts == ["tool `grep` failed: SystemExit: 2", "after"]
