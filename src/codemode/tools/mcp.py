"""The tools of MCP servers as nested tools (``pip install 'codemode[mcp]'``, the official SDK).

:func:`mcp_tools` connects to one server (a command over stdio, or a streamable HTTP URL) for the
duration of an ``async with`` and yields one :class:`~codemode.model.Tool` per server tool;
:func:`mcp_session_tools` does the same for a ``ClientSession`` you opened yourself (any transport,
your own authentication).

A server's tool ``TOOL`` is the nested tool ``mcp__SERVER__TOOL`` (namespace ``mcp__SERVER``). Its
input schema is declared as the argument type; its result is the serialized ``CallToolResult``,
``{content, isError?, structuredContent?, _meta?}``, declared to the model as ``CallToolResult<S>``
with ``S`` from the tool's output schema. A result the server flags ``isError`` resolves like any
other (``isError: true``, the server's text in ``content``), as the model is told; a protocol
failure rejects the call. A nested call the cell abandons is cancelled on the server: the SDK sends
``notifications/cancelled`` when the call's task is cancelled.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final

from codemode.model.registry import Tool
from codemode.protocol.types import JSON

if TYPE_CHECKING:
    from mcp import ClientSession, StdioServerParameters
    from mcp.types import Tool as McpTool

__all__ = ["MCP_NAMESPACE_PREFIX", "mcp_session_tools", "mcp_tools"]

#: A server's tools live in the namespace ``mcp__`` + the server's name.
MCP_NAMESPACE_PREFIX: Final = "mcp__"

_KEPT_RESULT_KEYS: Final = ("content", "isError", "structuredContent", "_meta")


def call_tool_result_schema(structured_content: JSON | None) -> dict[str, JSON]:
    """An MCP-shaped output schema (the model is shown ``CallToolResult<...>``)."""
    properties: dict[str, JSON] = {
        "content": {"type": "array", "items": {"type": "object"}},
        "isError": {"type": "boolean"},
        "_meta": {"type": "object"},
    }
    if structured_content is not None:
        properties["structuredContent"] = structured_content
    return {"type": "object", "properties": properties, "required": ["content"]}


def _make_tool(server: str, session: ClientSession, described: McpTool) -> Tool[..., Any]:
    name = described.name
    namespace = f"{MCP_NAMESPACE_PREFIX}{server}"

    async def call(arguments: dict[str, Any]) -> JSON:
        result = await session.call_tool(name, arguments)
        serialized = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        if not result.is_error:
            serialized.pop("isError", None)  # the declared type has it optional: omit `false`
        return {key: serialized[key] for key in _KEPT_RESULT_KEYS if key in serialized}

    return Tool.from_schema(
        name,
        described.description or described.title or "",
        described.input_schema,
        call,
        output_schema=call_tool_result_schema(described.output_schema),
        namespace=namespace,
    )


async def mcp_session_tools(server: str, session: ClientSession) -> list[Tool[..., Any]]:
    """The tools an initialized ``session`` lists, served through it as ``mcp__{server}__*``.

    The tools call the server only while ``session`` is open.
    """
    from mcp.types import PaginatedRequestParams

    if not server:
        raise ValueError("an MCP server needs a non-empty name")
    listed: list[McpTool] = []
    cursor: str | None = None
    while True:
        params = None if cursor is None else PaginatedRequestParams(cursor=cursor)
        page = await session.list_tools(params=params)
        listed.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return [_make_tool(server, session, described) for described in listed]


@contextlib.asynccontextmanager
async def mcp_tools(
    server: str, connection: StdioServerParameters | str
) -> AsyncIterator[list[Tool[..., Any]]]:
    """Connect to an MCP server and yield its tools, usable until the ``async with`` ends.

    ``connection`` is ``StdioServerParameters`` (the command is started, and stopped at the end)
    or the URL of a streamable HTTP endpoint. Enter and leave it in the same task.
    """
    from mcp import ClientSession
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client

    raised: BaseException | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(connection, str):
                transport = streamable_http_client(connection)
            else:
                transport = stdio_client(connection)
            read, write = await stack.enter_async_context(transport)
            session = await stack.enter_async_context(ClientSession(read, write))
            await session.initialize()
            tools = await mcp_session_tools(server, session)
            try:
                yield tools
            except BaseException as error:
                raised = error
                raise
    except BaseExceptionGroup as group:
        # The SDK's task groups wrap what the `async with` body raised: give it back bare.
        if raised is not None and _only(group, raised):
            raise raised from None
        raise


def _only(group: BaseExceptionGroup[BaseException], error: BaseException) -> bool:
    return all(
        _only(inner, error) if isinstance(inner, BaseExceptionGroup) else inner is error
        for inner in group.exceptions
    )
