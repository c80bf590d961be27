"""The model-facing layer: exec/wait tool definitions, result rendering, TypeScript declarations,
a Python tool registry that serves nested calls (``runtime.md`` §4.4, §15) and :class:`CodeMode`,
the one object an agent loop needs."""

from codemode.model.anthropic import AnthropicMessages
from codemode.model.chat_completions import ChatCompletions, ChatReply
from codemode.model.codemode import (
    CODE_MODE_CLOSED,
    EXEC_CODE_ARGUMENT,
    CodeMode,
    exec_code_parameters,
)
from codemode.model.exec_tool import (
    EXEC_GRAMMAR,
    NamespaceDescription,
    WaitArguments,
    build_exec_description,
    build_wait_description,
    exec_tool_spec,
    parse_wait_arguments,
    wait_tool_spec,
)
from codemode.model.handler import (
    CodeModeToolHandler,
    CustomToolInput,
    FunctionToolArguments,
)
from codemode.model.registry import (
    BeforeCall,
    Deny,
    NestedCall,
    Rewrite,
    Tool,
    ToolContext,
    ToolRegistry,
    flat_tool_name,
    tool,
)
from codemode.model.render import (
    RenderedOutput,
    estimate_tokens,
    render_outcome,
    render_response,
    truncate_items,
    truncate_middle,
)
from codemode.model.typescript import (
    normalize_identifier,
    render_json_schema,
    render_tool_declaration,
    render_tool_sample,
)

__all__ = [
    "CODE_MODE_CLOSED",
    "EXEC_CODE_ARGUMENT",
    "EXEC_GRAMMAR",
    "AnthropicMessages",
    "BeforeCall",
    "ChatCompletions",
    "ChatReply",
    "CodeMode",
    "CodeModeToolHandler",
    "CustomToolInput",
    "Deny",
    "FunctionToolArguments",
    "NamespaceDescription",
    "NestedCall",
    "RenderedOutput",
    "Rewrite",
    "Tool",
    "ToolContext",
    "ToolRegistry",
    "WaitArguments",
    "build_exec_description",
    "build_wait_description",
    "estimate_tokens",
    "exec_code_parameters",
    "exec_tool_spec",
    "flat_tool_name",
    "normalize_identifier",
    "parse_wait_arguments",
    "render_json_schema",
    "render_outcome",
    "render_response",
    "render_tool_declaration",
    "render_tool_sample",
    "tool",
    "truncate_items",
    "truncate_middle",
    "wait_tool_spec",
]
