"""Tool files (``codemode run --tools PATH.py``): loaded as ``python PATH.py`` would run them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from codemode.errors import CodeModeError
from codemode.model.registry import ToolRegistry
from codemode.model.toolfile import load_tool_file
from codemode.protocol.types import CellId, CodeModeNestedToolCall, CodeModeToolKind, ToolName
from codemode.session import CancellationToken


@pytest.fixture
def isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """sys.path as it was, and no module the test imported, after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


async def call(registry: ToolRegistry, name: str) -> object:
    invocation = CodeModeNestedToolCall(
        CellId("1"), "tool-1", ToolName(name, None), CodeModeToolKind.FUNCTION, {}
    )
    return await registry.invoke_tool(invocation, CancellationToken())


@pytest.mark.usefixtures("isolated_imports")
async def test_a_tool_file_imports_the_modules_beside_it(tmp_path: Path) -> None:
    # Its directory was never put on sys.path: `import helper` failed, unlike `python tools.py`.
    (tmp_path / "toolfile_helper_eager.py").write_text("def value() -> int:\n    return 42\n")
    (tmp_path / "toolfile_helper_lazy.py").write_text("def value() -> int:\n    return 7\n")
    tools = tmp_path / "tools.py"
    tools.write_text(
        "import toolfile_helper_eager\n\n"
        "def eager() -> int:\n"
        "    return toolfile_helper_eager.value()\n\n"
        "def lazy() -> int:\n"
        "    import toolfile_helper_lazy\n"
        "    return toolfile_helper_lazy.value()\n"
    )
    registry = load_tool_file(tools)
    assert sys.path[0] == str(tmp_path.resolve())
    assert await call(registry, "eager") == 42
    assert await call(registry, "lazy") == 7  # imported during the call, after loading


@pytest.mark.usefixtures("isolated_imports")
def test_tool_files_load_into_one_registry_and_a_name_defined_twice_is_refused(
    tmp_path: Path,
) -> None:
    first, second, again = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    first.write_text("def a() -> int:\n    return 1\n")
    second.write_text("def b() -> int:\n    return 2\n")
    again.write_text("def a() -> int:\n    return 3\n")
    registry = load_tool_file(first)
    assert load_tool_file(second, registry=registry) is registry
    assert [definition.name for definition in registry.definitions()] == ["a", "b"]
    with pytest.raises(CodeModeError) as caught:
        load_tool_file(again, registry=registry)
    assert caught.value.message == f"cannot register a of {again}: tool `a` is already registered"


REGISTRY_FILE = """
import asyncio
from codemode import Tool, ToolRegistry
from codemode.model import Deny

def deny_deletes(call):
    if call.tool.definition.name == "delete":
        return Deny("deleting needs approval")
    return None

registry = ToolRegistry(before_call=deny_deletes, timeout=0.2)
same_registry = registry

@registry.tool
def delete(path: str = "/") -> str:
    return "deleted"

@registry.tool
async def slow() -> str:
    await asyncio.sleep(30)
    return "done"

registry.add(Tool.from_schema("echo", "Echo.", {"type": "object"}, lambda arguments: "echo"))

def not_a_tool() -> int:
    return 1
"""


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("isolated_imports")
async def test_a_tool_file_with_a_registry_gives_its_tools_as_that_registry_serves_them(
    tmp_path: Path,
) -> None:
    # Its tools were taken one by one as module-level `Tool`s: the approval hook was bypassed
    # (and itself made a tool), the timeout dropped, a tool added without a name of its own
    # missing, the file's other functions exposed.
    tools = tmp_path / "guarded.py"
    tools.write_text(REGISTRY_FILE)
    registry = load_tool_file(tools)
    assert [definition.name for definition in registry.definitions()] == ["delete", "slow", "echo"]
    with pytest.raises(CodeModeError, match=r"^deleting needs approval$"):
        await call(registry, "delete")
    with pytest.raises(CodeModeError, match=r"^tool `slow` timed out after 0\.2 s$"):
        await call(registry, "slow")
    assert await call(registry, "echo") == "echo"
