"""``codemode run --tools``: tool files as a user lays them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.commands import codemode

pytestmark = pytest.mark.timeout(60)


def test_a_tool_file_imports_a_module_beside_it(tmp_path: Path) -> None:
    # ModuleNotFoundError: the file's directory was never on sys.path.
    (tmp_path / "helper.py").write_text("def helper_val() -> int:\n    return 42\n")
    tools = tmp_path / "tools.py"
    tools.write_text("import helper\n\ndef val() -> int:\n    return helper.helper_val()\n")
    done = codemode("run", "-", "--tools", str(tools), stdin=b"text(await tools.val())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(b"Output:\n\n42\n")


def test_repeated_tools_files_are_all_loaded(tmp_path: Path) -> None:
    # Only the last --tools was kept, silently.
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("def a() -> int:\n    return 1\n")
    second.write_text("def b() -> int:\n    return 2\n")
    source = b"text(Object.keys(tools).join()); text(await tools.a() + await tools.b())"
    done = codemode("run", "-", "--tools", str(first), "--tools", str(second), stdin=source)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(b"Output:\n\na,b\n3\n")


def test_a_tool_name_defined_by_two_files_is_a_usage_error(tmp_path: Path) -> None:
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("def a() -> int:\n    return 1\n")
    second.write_text("def a() -> int:\n    return 2\n")
    done = codemode("run", "-", "--tools", str(first), "--tools", str(second), stdin=b"text(1)")
    assert done.returncode == 2
    assert done.stdout == b""
    assert done.stderr == (
        f"codemode: cannot register a of {second}: tool `a` is already registered\n".encode()
    )
