"""LangChain tools as nested tools (``pip install 'codemode[langchain]'``).

A LangChain tool is declared to the model by the OpenAI schema LangChain itself derives
(``langchain_core.utils.function_calling.convert_to_openai_tool``) and run with ``ainvoke``, so
LangChain validates the arguments and the tool's own error handling applies. Arguments LangChain
keeps out of the model's schema (``InjectedToolArg`` and the like: the application's to supply) are
dropped from what a cell passes, as any key the schema does not declare is ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from codemode.model.registry import Tool
from codemode.tools.function_schema import openai_tool

if TYPE_CHECKING:
    from langchain_core.tools import BaseTool

__all__ = ["langchain_tool"]


def langchain_tool(tool: BaseTool, *, namespace: str | None = None) -> Tool[..., Any]:
    """The LangChain ``tool`` as a nested tool named like it (in ``namespace``, if given)."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    injected = _injected_arguments(tool)

    async def call(arguments: dict[str, Any]) -> Any:
        if injected:
            arguments = {key: value for key, value in arguments.items() if key not in injected}
        return await tool.ainvoke(arguments)

    return openai_tool(convert_to_openai_tool(tool), call, namespace=namespace)


def _injected_arguments(tool: BaseTool) -> frozenset[str]:
    """The arguments of ``tool`` left out of the schema the model is shown: a cell setting one
    (say a user id the application injects) would call the tool as nobody meant it to."""
    declared = getattr(tool.get_input_schema(), "model_fields", None)
    if not isinstance(declared, dict):
        return frozenset()
    shown = tool.tool_call_schema
    if isinstance(shown, dict):
        properties = shown.get("properties")
        visible = set(properties) if isinstance(properties, dict) else set()
    else:
        visible = set(getattr(shown, "model_fields", {}))
    return frozenset(set(declared) - visible)
