"""OpenAI function-tool definitions as nested tools.

The Responses API spells a function tool ``{"type": "function", "name", "description",
"parameters"}``; Chat Completions nests the same fields: ``{"type": "function", "function":
{...}}``. Either one, with the callable that implements it, becomes a
:class:`~codemode.model.Tool` through :meth:`~codemode.model.Tool.from_schema`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from codemode.model.registry import Tool
from codemode.protocol.types import JSON

__all__ = ["openai_tool"]

_EMPTY_OBJECT: dict[str, JSON] = {"type": "object", "properties": {}}


def openai_tool(
    definition: Mapping[str, Any],
    call: Callable[..., Any],
    *,
    namespace: str | None = None,
    output_schema: Mapping[str, JSON] | None = None,
) -> Tool[..., Any]:
    """The nested tool ``definition`` declares, served by ``call``.

    ``definition`` is an OpenAI function tool in the Responses or the Chat Completions shape;
    ``call`` (sync or async) receives the argument object as a ``dict`` (see
    :meth:`Tool.from_schema <codemode.model.Tool.from_schema>`). A definition without
    ``parameters`` takes an empty object. ``output_schema``, when given, declares the result.
    """
    if not isinstance(definition, Mapping) or definition.get("type") != "function":
        raise ValueError('an OpenAI function tool is a mapping with "type": "function"')
    body = definition.get("function", definition)
    if not isinstance(body, Mapping):
        raise ValueError('the "function" of a Chat Completions tool must be an object')
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("an OpenAI function tool needs a non-empty string name")
    description = body.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"tool `{name}`: description must be a string")
    parameters = body.get("parameters") or _EMPTY_OBJECT
    return Tool.from_schema(
        name,
        description,
        parameters,
        call,
        output_schema=output_schema,
        namespace=namespace,
    )
