"""codemode: the Code Mode protocol for Python.

Run model-written JavaScript cells that call your tools back, in process or on a remote host.
"""

import logging
from typing import TYPE_CHECKING, Any

from codemode.errors import (
    CodeModeError,
    ConnectionClosed,
    EngineLimitError,
    FrameError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    WireConversionError,
)
from codemode.protocol import (
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ContentItem,
    ExecuteRequest,
    ImageDetail,
    InputAudio,
    InputImage,
    InputText,
    LiveCell,
    MissingCell,
    ParsedExecSource,
    Result,
    RuntimeResponse,
    Terminated,
    ToolCallSite,
    ToolDefinition,
    ToolName,
    WaitOutcome,
    WaitRequest,
    Yielded,
    parse_exec_source,
)
from codemode.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    NoopCodeModeSessionDelegate,
    StartedCell,
)

if TYPE_CHECKING:
    from codemode.model import CodeMode, Tool, ToolRegistry, tool

__version__ = "0.1.0"

#: Imported on first use: a host process (``codemode host``, ``codex-code-mode-host``) never needs
#: the model-facing layer, and it is the larger part of what ``import codemode`` would load.
_MODEL_NAMES = frozenset({"CodeMode", "Tool", "ToolRegistry", "tool"})


def __getattr__(name: str) -> Any:
    if name in _MODEL_NAMES:
        import codemode.model

        return getattr(codemode.model, name)
    raise AttributeError(f"module 'codemode' has no attribute {name!r}")


# A library logs only where its application configures logging: without this handler Python's
# last-resort handler would print codemode's warnings and tracebacks to stderr.
logging.getLogger("codemode").addHandler(logging.NullHandler())

__all__ = [
    "CancellationToken",
    "CellId",
    "CodeMode",
    "CodeModeError",
    "CodeModeNestedToolCall",
    "CodeModeSession",
    "CodeModeSessionCellExecutionLimits",
    "CodeModeSessionDelegate",
    "CodeModeSessionProvider",
    "CodeModeToolKind",
    "ConnectionClosed",
    "ContentItem",
    "EngineLimitError",
    "ExecuteRequest",
    "FrameError",
    "ImageDetail",
    "InputAudio",
    "InputImage",
    "InputText",
    "LiveCell",
    "LocalProtocolError",
    "MissingCell",
    "NoopCodeModeSessionDelegate",
    "ParsedExecSource",
    "ProtocolError",
    "RemoteProtocolError",
    "Result",
    "RuntimeResponse",
    "StartedCell",
    "Terminated",
    "Tool",
    "ToolCallSite",
    "ToolDefinition",
    "ToolName",
    "ToolRegistry",
    "WaitOutcome",
    "WaitRequest",
    "WireConversionError",
    "Yielded",
    "parse_exec_source",
    "tool",
]
