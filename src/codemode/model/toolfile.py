"""Load the tools of a Python file (``codemode run --tools PATH.py``).

Every public function defined at the top level of the file becomes a nested tool, by the one rule
:func:`~codemode.model.registry.tool` follows: its parameters (and their type hints) are the
properties of the object the cell passes, its docstring the description, its return annotation
the result type the model is shown. A function decorated with ``@tool`` keeps its own metadata
(name, namespace, schema). A file that defines a :class:`ToolRegistry` at the top level gives the
tools registered there instead, as that registry serves them (its ``before_call``, its
timeouts): its other functions, the hook among them, are not tools.

The file imports as ``python PATH.py`` would run it: its directory is first on ``sys.path``, so
that it can import the modules beside it (and it stays there: a tool may import one lazily).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from codemode.errors import CodeModeError
from codemode.model.registry import NotifyCallback, Tool, ToolRegistry, tool

__all__ = ["load_tool_file"]


def load_tool_file(
    path: str | Path,
    *,
    on_notify: NotifyCallback | None = None,
    registry: ToolRegistry | None = None,
) -> ToolRegistry:
    """Import ``path`` and register its public top-level functions (see the module docstring)
    in ``registry`` (a new one if None, with ``on_notify``); returns the registry."""
    file = Path(path)
    if not file.is_file():
        what = "is a directory, not a Python file" if file.is_dir() else "not found"
        raise CodeModeError(f"tool file {what}: {file}")
    directory = str(file.resolve().parent)
    if sys.path[:1] != [directory]:
        sys.path.insert(0, directory)
    module_name = f"codemode_tools_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise CodeModeError(f"cannot load tools from {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # sys.exit() at import is a failure to load too
        del sys.modules[module_name]
        raise CodeModeError(
            f"failed to load tools from {file}: {type(error).__name__}: {error}"
        ) from error
    if registry is None:
        registry = ToolRegistry(on_notify=on_notify)
    # Its registries, once each (one may have two names). Registering their tools one by one
    # dropped the hook and the timeouts, made a tool of the hook, and missed a tool added
    # without a name of its own (`registry.add(Tool.from_schema(...))`).
    declared = {
        id(value): (name, value)
        for name, value in vars(module).items()
        if not name.startswith("_") and isinstance(value, ToolRegistry)
    }
    for name, declared_registry in declared.values():
        try:
            registry.include(declared_registry)
        except ValueError as error:  # a name taken (by another file, or an MCP server)
            raise CodeModeError(f"cannot register the tools of {name} of {file}: {error}") from None
    if declared:
        return registry
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        try:
            if isinstance(value, Tool):
                item: Tool[..., Any] = value
            elif inspect.isfunction(value) and value.__module__ == module_name:
                item = tool(value)
            else:
                continue
        except (TypeError, ValueError) as error:
            raise CodeModeError(f"cannot use {name} of {file} as a tool: {error}") from None
        try:
            registry.add(item)
        except ValueError as error:  # its name is taken (by another file, or an MCP server)
            raise CodeModeError(f"cannot register {name} of {file}: {error}") from None
    return registry
