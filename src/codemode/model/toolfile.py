"""Load the tools of a Python file (``codemode run --tools PATH.py``).

Every public function defined at the top level of the file becomes a nested tool: a function
decorated with :func:`~codemode.model.registry.tool` keeps its metadata (name, namespace, schema
from its type hints); a plain function (sync or async) becomes a function tool named after it that
is called with the cell's one JSON argument and returns a JSON value.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from codemode.errors import CodeModeError
from codemode.model.registry import NotifyCallback, Tool, ToolRegistry, tool

__all__ = ["load_tool_file", "plain_tool"]


def plain_tool(function: Callable[..., Any]) -> Tool[..., Any]:
    """A tool that passes the cell's JSON argument (an object, ``{}`` when absent) as-is."""
    description = inspect.getdoc(function) or ""
    if inspect.iscoroutinefunction(function):

        async def call_async(**arguments: Any) -> Any:
            return await function(arguments)

        return tool(name=function.__name__, description=description)(call_async)

    def call(**arguments: Any) -> Any:
        return function(arguments)

    return tool(name=function.__name__, description=description)(call)


def load_tool_file(path: str | Path, *, on_notify: NotifyCallback | None = None) -> ToolRegistry:
    """Import ``path`` and register its public top-level functions (see the module docstring)."""
    file = Path(path)
    if not file.is_file():
        raise CodeModeError(f"tool file not found: {file}")
    module_name = f"codemode_tools_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise CodeModeError(f"cannot load tools from {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise CodeModeError(
            f"failed to load tools from {file}: {type(error).__name__}: {error}"
        ) from error
    registry = ToolRegistry(on_notify=on_notify)
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if isinstance(value, Tool):
            registry.add(value)
        elif inspect.isfunction(value) and value.__module__ == module_name:
            registry.add(plain_tool(value))
    return registry
