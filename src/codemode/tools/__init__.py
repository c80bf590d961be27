"""Tool sources beyond plain Python functions, each turned into :class:`~codemode.model.Tool` values.

Every source goes through :meth:`Tool.from_schema <codemode.model.Tool.from_schema>`, so the tools
it makes register in a :class:`~codemode.model.ToolRegistry` (or go to
:class:`~codemode.model.CodeMode`) like any other:

* :func:`openai_tool`: an OpenAI function-tool definition (Responses or Chat Completions shape)
  and the callable that implements it;
* :func:`langchain_tool`: a LangChain tool (``codemode[langchain]``);
* :func:`mcp_tools`: the tools of an MCP server over stdio or streamable HTTP, for the duration of
  an ``async with`` (``codemode[mcp]``); :func:`mcp_session_tools` for a session you opened.

The optional libraries are imported only when these functions run.
"""

from codemode.tools.function_schema import openai_tool
from codemode.tools.langchain import langchain_tool
from codemode.tools.mcp import mcp_session_tools, mcp_tools

__all__ = ["langchain_tool", "mcp_session_tools", "mcp_tools", "openai_tool"]
