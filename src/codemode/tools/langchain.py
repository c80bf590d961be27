"""LangChain tools as nested tools (``pip install 'codemode[langchain]'``).

A LangChain tool is declared to the model by the OpenAI schema LangChain itself derives
(``langchain_core.utils.function_calling.convert_to_openai_tool``) and run with ``ainvoke``, so
LangChain validates the arguments and the tool's own error handling applies.
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

    async def call(arguments: dict[str, Any]) -> Any:
        return await tool.ainvoke(arguments)

    return openai_tool(convert_to_openai_tool(tool), call, namespace=namespace)
